"""The monitor driven by Pilot: keys, dialogs, live updates and faults on contract-true folders."""

from __future__ import annotations

import json
import shutil
import tempfile

from longspec_cli.tui.monitor_app import MonitorApp
from longspec_cli.tui.widgets.confirm import ConfirmScreen
from longspec_cli.tui.widgets.help import HelpScreen
from tests.tui import fixtures as F
from tests.tui.conftest import RUNNING_CLOCK
from tests.tui.pilot_helpers import screen_text, settle, wait_until

SIZE = (120, 40)


def _app(root, sampler, recorder=None, **kw) -> MonitorApp:
    return MonitorApp(root, poll_s=0.1, sampler=sampler, cli=recorder.cli if recorder else None,
                      deep_check=False, **kw)


def _panel_text(app) -> str:
    """The screen rows of the stage panel."""
    region = app.panel.region
    rows = screen_text(app).splitlines()[region.y:region.bottom]
    return "\n".join(r[region.x:region.right] for r in rows)


async def test_live_record_shows_up_and_q_quits(running, sampler):
    app = _app(running, sampler, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.view.stages[1].state == "running" and "120 / 400" in _panel_text(app)
        with open(running / "runs/long/metrics.jsonl", "a") as f:
            f.write(json.dumps(F.step_record(121, 400, 1)) + "\n")
        await wait_until(pilot, lambda: "121 / 400" in _panel_text(app), 5, "step 121 on screen")
        await pilot.press("q")
        await wait_until(pilot, lambda: not app.is_running, 5, "exit")


async def test_left_right_view_other_stages(running, sampler):
    app = _app(running, sampler, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert "long" in _panel_text(app)
        await pilot.press("left")
        assert app.selected == 0 and "base  done" in _panel_text(app)
        await pilot.press("left")  # stays on the first stage
        assert app.selected == 0
        await pilot.press("right", "right")
        assert app.selected == 2 and "longcot  pending" in _panel_text(app)


async def test_help_opens_and_closes(running, sampler):
    app = _app(running, sampler, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def _open_next_stage_dialog(pilot, app) -> ConfirmScreen:
    await settle(pilot, app)
    assert app.view.stages[app.view.current].name == "base"
    await pilot.press("n")
    await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 10, "the next-stage dialog")
    return app.screen


async def test_next_stage_shows_the_diff_and_writes_on_confirm(base_done, sampler):
    cfg = base_done / "conf/exp/long.yaml"
    weights = base_done / "runs/base/draft_model_weights.pth"
    app = _app(base_done, sampler)
    async with app.run_test(size=SIZE) as pilot:
        dialog = await _open_next_stage_dialog(pilot, app)
        diff = dialog.body.code
        assert f"+draft_model_name_or_path: {weights}" in diff and "-draft_model_name_or_path: null" in diff
        assert cfg.read_text().count(str(weights)) == 0  # nothing written while asking
        await pilot.press("y")
        await wait_until(pilot, lambda: str(weights) in cfg.read_text(), 10, "the config edit")
    assert f"draft_model_name_or_path: {weights}\n" in cfg.read_text()


async def test_next_stage_cancel_leaves_the_file_untouched(base_done, sampler):
    cfg = base_done / "conf/exp/long.yaml"
    before = cfg.read_bytes()
    app = _app(base_done, sampler)
    async with app.run_test(size=SIZE) as pilot:
        await _open_next_stage_dialog(pilot, app)
        await pilot.press("n")
        await wait_until(pilot, lambda: not isinstance(app.screen, ConfirmScreen), 5, "dialog closed")
        await pilot.pause(0.3)
    assert cfg.read_bytes() == before


async def test_next_stage_refused_on_a_running_stage(running, sampler):
    app = _app(running, sampler, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("n")
        await pilot.pause(0.2)
        assert not isinstance(app.screen, ConfirmScreen)
        assert any("needs a done stage" in n.message for n in app._notifications)


async def test_stop_asks_then_runs_longspec_stop(running, sampler, recorder, tmp_path, monkeypatch):
    logs = tmp_path / "tmp"
    logs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(logs))     # where the command's output goes
    app = _app(running, sampler, recorder, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("s")
        assert isinstance(app.screen, ConfirmScreen) and "Stop long?" in app.screen.title_text
        await pilot.press("n")  # cancel: nothing is started
        await pilot.pause(0.5)
        assert recorder.calls() == []
        await pilot.press("s")
        await pilot.press("y")
        await wait_until(pilot, lambda: recorder.calls() != [], 10, "longspec stop")
        await wait_until(pilot, lambda: any("stop long: done" in n.message for n in app._notifications),
                         10, "the stop's notification")
    assert recorder.calls() == [["stop", str(running)]]
    assert list(logs.iterdir()) == []                         # its output file went with it


async def test_run_starts_the_first_stage_of_a_fresh_project(fresh, sampler, recorder):
    app = _app(fresh, sampler, recorder)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert "no runs yet" in screen_text(app)
        await pilot.press("r")
        await wait_until(pilot, lambda: recorder.calls() != [], 10, "longspec run")
    assert recorder.calls() == [["run", str(fresh), "base"]]


async def test_run_refuses_while_a_stage_runs(running, sampler, recorder):
    app = _app(running, sampler, recorder, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("r")
        await pilot.pause(0.5)
        assert recorder.calls() == []
        assert any("long is running" in n.message for n in app._notifications)


async def test_faults_are_notices_not_crashes(running, sampler):
    app = _app(running, sampler, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        with open(running / "runs/long/metrics.jsonl", "a") as f:
            f.write("{broken\n" + '{"step": 121, "lo')  # malformed line + partial line
        (running / "runs/long/train.log").write_text("log rotated\n")
        await wait_until(pilot, lambda: "malformed" in _panel_text(app), 5, "the malformed-line note")
        await wait_until(pilot, lambda: any("train.log was" in n.message for n in app._notifications), 5,
                         "the train.log notice")
        shutil.rmtree(running / "runs/long")
        await wait_until(pilot, lambda: any("was deleted" in n.message for n in app._notifications), 5,
                         "the deleted-folder notice")
        await wait_until(pilot, lambda: app.view.stages[1].state == "pending", 10, "long back to pending")
        assert app.is_running


async def test_log_tail_appends_repeated_lines(running, sampler):
    app = _app(running, sampler, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        before = list(app.log_tail.lines)
        for _ in range(2):
            with open(running / "runs/long/train.log", "a") as f:
                f.write("same line\n" * 3)
            await pilot.pause(0.4)
        await wait_until(pilot, lambda: len(app.log_tail.lines) == len(before) + 6, 5, "six new log lines")
        assert list(app.log_tail.lines) == before + ["same line"] * 6


async def test_the_tau_by_length_chart_shows_each_evaluated_stage_and_its_input_draft(running, sampler):
    sha = json.loads((running / "runs/base/stage_complete.json").read_text())["sha256"]

    def bucket(n, tau, base):
        return {"length": n, "prompts": 8, "chain": {"tau": tau}, "baseline": {"tau": base}}

    (running / "runs/base/eval.json").write_text(json.dumps(
        {"stage": "base", "tau": 2.4, "gamma": 4, "lossless": True, "draft_sha256": sha, "method": "chain",
         "by_length": [bucket(256, 2.1, 1.7), bucket(512, 2.8, 1.6), {"length": 1024, "prompts": 0}]}))
    app = _app(running, sampler)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        chart = app.query_one("#tau-chart")

        def chart_text() -> str:
            region = chart.region
            rows = screen_text(app).splitlines()[region.y:region.bottom]
            return "\n".join(r[region.x:region.right] for r in rows)

        await wait_until(pilot, lambda: chart.display and "tau by context length" in chart_text(),
                         10, "the tau chart drawn from eval.json")
        text = chart_text()
        assert "256" in text and "512" in text and "1k" not in text        # buckets with prompts only
        view = next(s for s in app.view.stages if s.name == "base")
        assert view.tau_by_length == ((256, "256", 2.1, 1.7), (512, "512", 2.8, 1.6))


def _simtau(step: int, tau: float, alpha: list[float]) -> str:
    return json.dumps({"record": "simtau", "step": step, "total_steps": 400, "tau": tau, "alpha": alpha,
                       "gamma": len(alpha), "positions": 4000, "records": 30, "best": False, "time": 1.0}) + "\n"


async def test_simulated_tau_chart_follows_the_stage_and_alerts_when_it_falls_while_loss_falls(running, sampler):
    app = _app(running, sampler, clock=lambda: RUNNING_CLOCK)
    async with app.run_test(size=(160, 44)) as pilot:
        await settle(pilot, app)
        assert "simulated tau: none yet" in screen_text(app)
        with open(running / "runs/long/metrics.jsonl", "a") as f:
            for step, tau in ((0, 1.4), (20, 1.9), (40, 2.3)):
                a = round((tau - 1) / 2, 3)
                f.write(_simtau(step, tau, [a, a, a, a]))
        await wait_until(pilot, lambda: "sim tau 2.30@40 best 2.30@40" in screen_text(app), 5,
                         "the chart's title")
        chart = app.simtau_chart
        assert [p.tau for p in app.view.stages[1].simtau] == [1.4, 1.9, 2.3]
        assert chart.plotted == ["tau", "a1", "a2", "a3", "a4"]    # tau and the four per-position rates
        assert not any(a.kind == "simtau_falling" for a in app.view.alerts)
        # three falls in a row while the step records' loss keeps falling: the alert
        with open(running / "runs/long/metrics.jsonl", "a") as f:
            for step, tau in ((60, 2.2), (80, 2.0), (100, 1.8)):
                f.write(_simtau(step, tau, [0.4, 0.4, 0.4, 0.4]))
        await wait_until(pilot, lambda: any(a.kind == "simtau_falling" for a in app.view.alerts), 5, "alert")
        alert = next(a for a in app.view.alerts if a.kind == "simtau_falling")
        assert "simulated tau fell 3 evaluations in a row (2.30 at step 40 -> 1.80 at step 100)" in alert.message
        assert "simulated tau fell" in screen_text(app)                 # in the alerts panel
        # status reads the same record through runs.runfolder
        from longspec.runs.status import project_status
        from longspec.project.manifest import load_manifest

        long = project_status(load_manifest(running))[1]
        assert (long.sim_tau, long.sim_tau_step) == (1.8, 100)
