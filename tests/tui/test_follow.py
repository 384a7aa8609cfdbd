"""ProjectFollower on contract-true run folders: first screen from tails, history merged later,
and every fault (malformed lines, rewrites, deleted folders, no runs) as a notice, not a crash."""

from __future__ import annotations

import json
import shutil

from longspec_cli.tui import follow as FL
from tests.tui import fixtures as F


def _ready(root, clock=None):
    f = FL.ProjectFollower(root, **({"clock": clock} if clock else {})).open()
    f.set_status(*f.refresh_status())
    return f


def test_running_pipeline_view(running):
    f = _ready(running, clock=lambda: F.T0 + 1e5 + 180)
    v = f.view()
    assert [s.state for s in v.stages] == ["done", "running", "pending"]
    assert v.current == 1 and v.notice is None and v.alerts == ()
    base, long = v.stages[0], v.stages[1]
    assert base.sha256 == json.loads((running / "runs/base/stage_complete.json").read_text())["sha256"]
    assert (long.step, long.total_steps) == (120, 400)
    assert long.loss == F.step_record(120, 400, 1)["loss"]
    assert long.eta_s == (400 - 120) * F.STEP_S  # from the records' own clock
    assert long.log[-1].startswith("[rank0] step 120/400")


def test_history_merge_equals_a_full_read(tmp_path, monkeypatch):
    monkeypatch.setattr(FL, "TAIL_RECORDS", 50)
    root = F.make_project(tmp_path / "demo")
    out = F.write_run(root, "base", steps=700, total=700, done=False)
    f = FL.ProjectFollower(root).open()
    st = f.stages[0]
    assert len(st.series) <= 50 and not st.history_loaded  # the tail: 50 lines, events included
    with open(out / "metrics.jsonl", "a") as fh:  # a record lands while history is loading
        fh.write(json.dumps(F.step_record(701, 800)) + "\n")
    hist = f.load_history(0)
    f.poll()
    assert f.merge_history(hist) and st.history_loaded
    assert list(st.series.steps) == [float(i) for i in range(1, 702)]
    assert st.total_steps == 800


def test_history_of_an_older_generation_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(FL, "TAIL_RECORDS", 10)
    root = F.make_project(tmp_path / "demo")
    out = F.write_run(root, "base", steps=100, total=100, done=False)
    f = FL.ProjectFollower(root).open()
    hist = f.load_history(0)
    (out / "metrics.jsonl").write_text(json.dumps(F.step_record(1, 5)) + "\n")  # rewritten meanwhile
    f.poll()
    assert not f.merge_history(hist)
    assert list(f.stages[0].series.steps) == [1.0]
    assert any("truncated or replaced" in n for n in f.stages[0].notices)


def test_malformed_and_partial_lines_are_skipped_and_counted(tmp_path):
    root = F.make_project(tmp_path / "demo")
    out = F.write_run(root, "base", steps=20, total=100, done=False)
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write("{not json\n[1, 2]\n" + json.dumps(F.step_record(21, 100)) + "\n" + '{"step": 22, "lo')
    f = FL.ProjectFollower(root).open()
    st = f.view().stages[0]
    assert st.step == 21 and st.skipped_lines == 2
    with open(out / "metrics.jsonl", "a") as fh:  # the partial line is completed
        fh.write('ss": 2.5, "total_steps": 100}\n')
    f.poll()
    assert f.view().stages[0].step == 22 and f.view().stages[0].loss == 2.5


def test_nonfinite_loss_alert_from_a_live_record(running):
    f = _ready(running, clock=lambda: F.T0 + 1e5 + 200)
    with open(running / "runs/long/metrics.jsonl", "a") as fh:
        fh.write('{"step": 121, "total_steps": 400, "loss": NaN, "llm_loss": NaN, "lr": 1e-5, "time": %f}\n'
                 % (F.T0 + 1e5 + 181.5))
    f.poll()
    kinds = [a.kind for a in f.view().alerts]
    assert kinds == ["nonfinite_loss"]


def test_train_log_truncated_and_overflow_storm(running):
    f = _ready(running, clock=lambda: F.T0 + 1e5 + 180)
    log = running / "runs/long/train.log"
    log.write_text("restarted\n")
    f.poll()
    st = f.view().stages[1]
    assert st.log == ("restarted",) and any("train.log was truncated" in n for n in st.notices)
    with open(log, "a") as fh:
        fh.write("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 8, reducing to 4\n" * 9)
    f.poll()
    assert [a.kind for a in f.view().stages[1].alerts] == ["overflow_storm"]


def test_stage_folder_deleted_while_watched(running):
    f = _ready(running, clock=lambda: F.T0 + 1e5 + 180)
    shutil.rmtree(running / "runs/long")
    f.poll()
    st = f.stages[1]
    assert any("was deleted" in n for n in st.notices)
    assert f.status_due()
    f.set_status(*f.refresh_status())
    v = f.view().stages[1]
    assert v.state == "pending" and v.step is None and v.log == ()


def test_no_runs_yet_is_a_notice(fresh):
    f = _ready(fresh)
    v = f.view()
    assert v.notice and "no runs yet" in v.notice
    assert [s.state for s in v.stages] == ["pending"] * 3 and v.current == 0


def test_stall_and_process_gone(running):
    now = [F.T0 + 1e5 + 180]
    f = _ready(running, clock=lambda: now[0])
    assert f.view().alerts == ()
    now[0] += 60  # 40 x the 1.5 s between records
    assert [a.kind for a in f.view().alerts] == ["stalled"]
    info = json.loads((running / "runs/long/run.json").read_text())
    info.update(pid=F.DEAD_PID, proc_start=F.DEAD_START)  # the trainer died
    (running / "runs/long/run.json").write_text(json.dumps(info))
    f.poll()
    f.set_status(*f.refresh_status())
    v = f.view()
    assert v.stages[1].state == "failed"
    assert "process_gone" in [a.kind for a in v.alerts]


def test_an_idle_run_reports_no_change(running):
    f = _ready(running)
    f.poll()
    assert f.poll() is False and f.poll() is False  # nothing new: the UI repaints nothing
    assert f.view() == f.view()


def test_unreadable_file_is_a_notice_once(running):
    f = _ready(running, clock=lambda: F.T0 + 1e5 + 180)
    log = running / "runs/long/train.log"
    log.unlink()
    log.mkdir()  # a folder where the log should be: reading it fails with an OSError
    assert f.poll() is True
    assert f.poll() is False  # the same error is not reported again
    assert sum("cannot read the run folder" in n for n in f.stages[1].notices) == 1
    g = FL.ProjectFollower(running).open()  # opening such a project works too
    assert any("cannot read" in n for n in g.stages[1].notices)
