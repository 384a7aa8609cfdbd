"""SVG snapshots (pytest-textual-snapshot) of both apps on fixed data: fixed terminal size, fixed
clock, fixed system sample, no paths or pids on screen. Update with `--snapshot-update` after
checking the report that a change is intended."""

from __future__ import annotations

from textual.widgets import Input

from longspec_cli.tui.monitor_app import MonitorApp
from longspec_cli.tui.wizard_app import WizardApp
from tests.tui.conftest import RUNNING_CLOCK
from tests.tui.pilot_helpers import settle, wait_until

SIZE = (120, 40)


def _monitor(root, sampler) -> MonitorApp:
    return MonitorApp(root, poll_s=0.1, sampler=sampler, clock=lambda: RUNNING_CLOCK, deep_check=False)


def test_monitor_running_pipeline(snap_compare, running, sampler):
    """base done (its draft's sha256 on the chain), long running at 120/400, charts, log, no alerts."""
    app = _monitor(running, sampler)

    async def ready(pilot):
        await settle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_monitor_viewing_a_finished_stage(snap_compare, running, sampler):
    """left: the panel shows base's final numbers; the strip highlights base."""
    app = _monitor(running, sampler)

    async def ready(pilot):
        await settle(pilot, app)
        await pilot.press("left")

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_monitor_project_without_runs(snap_compare, fresh, sampler):
    """Every stage pending, empty charts, the 'no runs yet' notice."""
    app = _monitor(fresh, sampler)

    async def ready(pilot):
        await settle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_monitor_help(snap_compare, running, sampler):
    app = _monitor(running, sampler)

    async def ready(pilot):
        await settle(pilot, app)
        await pilot.press("question_mark")

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_wizard_empty_form(snap_compare):
    """The form before anything is typed: the checks say what is missing, nothing to preview."""
    app = WizardApp()

    async def ready(pilot):
        for field in app.query(Input):
            field.cursor_blink = False
        await wait_until(pilot, app.plan_shown.is_set, 10, "the first plan")
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=(120, 45), run_before=ready)
