"""Waiting helpers for Pilot tests: poll a condition between Textual pauses, with a deadline."""

from __future__ import annotations

import time


async def wait_until(pilot, cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.05)


async def settle(pilot, app, timeout: float = 15.0) -> None:
    """The monitor has its first status, its history, and has shown the view that includes them."""
    await wait_until(pilot, lambda: app.status_done.is_set() and app.history_done.is_set(), timeout, "status+history")
    await wait_until(pilot, lambda: app.view is not None and all(s.state != "checking" for s in app.view.stages),
                     timeout, "a view with states")
    await pilot.pause(0.1)


def screen_text(app) -> str:
    """What the terminal shows right now, as plain text (the active screen and those below it)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor", record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens,
                                                       simplify=True))
    return console.export_text()
