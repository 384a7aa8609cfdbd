"""Typed errors, their exit codes and the one red panel that shows them (the ground floor: no
longspec_cli module is imported here; `longspec_cli.boundary.run_cli` turns them into an exit).

Exit codes (README, docs/DESIGN.md):
  0 ok, 1 problems found / refused, 2 usage, 3 unreadable input, 4 a training run failed (a full
  disk included), 5 training was preempted (a stop signal saved a checkpoint; a rerun resumes),
  6 a regeneration stopped because no server answered (the rows done are kept; a rerun goes on),
  7 a regeneration ended with failed rows (a rerun asks them again), 130 Ctrl-C.
"""

from __future__ import annotations


OK = 0
REFUSED = 1
USAGE = 2
BAD_INPUT = 3
RUN_FAILED = 4
PREEMPTED = 5
SERVERS_GONE = 6
ROWS_FAILED = 7
INTERRUPTED = 130

class LongspecError(Exception):
    """A mistake or condition a user can act on: printed as a short panel, never a traceback."""

    exit_code = REFUSED

    def __init__(self, message: str, hint: str | None = None, *, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code


class RefusedError(LongspecError):
    exit_code = REFUSED


class UsageError(LongspecError):
    exit_code = USAGE


class InputError(LongspecError):
    """A file we had to read is missing, malformed, truncated or unsafe."""

    exit_code = BAD_INPUT


class RunFailed(LongspecError):
    exit_code = RUN_FAILED


def print_error(err: LongspecError) -> None:
    """The red panel; without its box when a word (a path, a command to copy) is wider than the
    box: a panel folds such a word across lines, so the path or command could not be copied."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    body = Text(err.message)
    if err.hint:
        body.append("\n")
        body.append("hint: ", style="bold")
        body.append(err.hint)
    console = Console(stderr=True)
    if max(map(len, body.plain.split()), default=0) > console.width - 4:   # the box's inner width
        console.print(Text("error: ", style="bold red") + body, soft_wrap=True)
        return
    console.print(Panel(body, title="[bold red]error[/]", title_align="left", border_style="red", expand=False))
