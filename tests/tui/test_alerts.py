"""Alert rules over records and log lines (no textual, no files)."""

from __future__ import annotations

import math

from longspec_cli.tui import alerts as A


def test_nonfinite_loss_raises_an_error_alert():
    for bad in (float("nan"), float("inf"), -math.inf, None, "nan"):
        a = A.check_record({"step": 7, "loss": bad, "llm_loss": 1.0, "lr": 1e-4}, "base")
        assert a is not None and a.level == A.ERROR and a.kind == "nonfinite_loss" and "step 7" in a.message
    a = A.check_record({"step": 8, "loss": 2.0, "llm_loss": float("nan")}, "base")
    assert a is not None and "llm_loss" in a.message


def test_finite_records_and_events_raise_nothing():
    assert A.check_record({"step": 7, "loss": 2.5, "llm_loss": 2.4, "lr": 1e-4}, "base") is None
    assert A.check_record({"event": "checkpoint", "step": 7, "path": "checkpoint-7"}, "base") is None
    assert A.check_record({"event": "start", "step": 0, "total_steps": 9}, "base") is None


def test_error_event_is_an_alert_with_its_message():
    a = A.check_record({"event": "error", "step": 12, "message": "CUDA out of memory"}, "long")
    assert a is not None and a.kind == "run_error" and "CUDA out of memory" in a.message and "12" in a.message


# DeepSpeed's fp16 loss-scaler lines (several versions word them differently)
OVERFLOW_OLD = "[INFO] [stage_1_and_2.py:1779:step] Grad overflow on iteration 12, reducing loss scale to 2048.0"
OVERFLOW_NEW = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4096, reducing to 2048"
AT_MIN = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


def test_scale_collapse_on_minimum_message():
    w = A.LogWatch()
    w.feed(["step 1 loss 3.2", AT_MIN])
    kinds = [a.kind for a in w.alerts("base")]
    assert "scale_collapse" in kinds


def test_scale_collapse_when_reduced_to_one_and_recovers_after_increase():
    w = A.LogWatch()
    w.feed(["[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 2, reducing to 1"])
    assert w.scale == 1.0 and [a.kind for a in w.alerts("base")] == ["scale_collapse"]
    w.feed(["No Grad overflow for 1000 iterations", "Increasing dynamic loss scale from 1.0 to 2.0"])
    assert w.scale == 2.0 and w.alerts("base") == []


def test_overflow_storm_needs_many_recent_overflows():
    w = A.LogWatch(window=50, count=8)
    w.feed([OVERFLOW_OLD] * 3 + ["step line"] * 20)  # the usual few overflows while the scale settles
    assert w.alerts("base") == []
    w.feed([OVERFLOW_NEW] * 8)
    storm = [a for a in w.alerts("base") if a.kind == "overflow_storm"]
    assert storm and storm[0].level == A.WARNING
    w.feed(["step line"] * 50)  # the storm scrolled out of the window: the alert clears
    assert [a for a in w.alerts("base") if a.kind == "overflow_storm"] == []


def test_no_grad_overflow_line_is_not_an_overflow():
    w = A.LogWatch(window=10, count=2)
    w.feed(["No Grad overflow for 1000 iterations"] * 5)
    assert w.overflows == 0 and w.alerts("base") == []


def test_reset_forgets_a_rotated_log():
    w = A.LogWatch()
    w.feed([AT_MIN])
    w.reset()
    assert w.alerts("base") == []


def test_stall_after_five_median_intervals():
    clock = A.StepClock()
    for t in (0, 30, 60, 90, 120):  # 30 s between records
        clock.add(t)
    med = clock.median_interval()
    assert med == 30
    assert A.stall_alert(med, 140.0, "base") is None  # under 5 x 30 s
    a = A.stall_alert(med, 151.0, "base")
    assert a is not None and a.kind == "stalled" and "2 min" in a.message


def test_stall_has_a_floor_and_needs_history():
    assert A.stall_alert(0.2, 5.0, "base") is None  # 5 x 0.2 s, but a checkpoint save is not a stall
    assert A.stall_alert(0.2, 11.0, "base") is not None
    clock = A.StepClock()
    clock.add(0)
    clock.add(1)
    assert clock.median_interval() is None  # two records say nothing yet
    assert A.stall_alert(None, 1e6, "base") is None


def test_stall_text_changes_rarely():
    msgs = {A.stall_alert(1.0, s, "base").message for s in range(61, 119)}
    assert len(msgs) == 1  # one repaint per mark, not one per second


def test_process_gone_only_for_a_dead_local_process_without_completion():
    info = {"pid": 4242, "host": "node-a"}
    a = A.process_gone("long", info, alive=False, complete=False)
    assert a is not None and a.level == A.ERROR and "4242" in a.message
    assert A.process_gone("long", info, alive=True, complete=False) is None
    assert A.process_gone("long", info, alive=None, complete=False) is None  # another host: unknown
    assert A.process_gone("long", info, alive=False, complete=True) is None
    assert A.process_gone("long", None, alive=False, complete=False) is None


def test_simtau_falling_needs_three_falls_in_a_row_while_the_loss_falls():
    from longspec_cli.tui.simtau_series import SimTauSeries, falling_alert

    s = SimTauSeries()
    for step, tau in ((0, 1.5), (10, 2.4), (20, 2.2), (30, 2.1)):
        s.add({"step": step, "tau": tau, "alpha": [0.5]})
    steps = list(range(1, 41))
    falling = [5.0 - 0.05 * x for x in steps]
    rising = [3.0 + 0.05 * x for x in steps]
    assert falling_alert(s.points, steps, falling, "long") is None            # two falls only
    s.add({"step": 40, "tau": 2.0, "alpha": [0.5]})
    a = falling_alert(s.points, steps, falling, "long")
    assert a is not None and a.kind == "simtau_falling" and "2.40 at step 10 -> 2.00 at step 40" in a.message
    assert "best/ keeps the draft of step 10" in a.message
    assert falling_alert(s.points, steps, rising, "long") is None              # loss rising too: no alert
    # a resume from an earlier checkpoint drops the later points
    s.add({"step": 20, "tau": 2.5, "alpha": [0.5]})
    assert [p.step for p in s.points] == [0, 10, 20] and falling_alert(s.points, steps, falling, "long") is None
