"""Typed errors and the one place where the CLI turns them into a message and an exit code.

Exit codes (README, docs/DESIGN.md):
  0 ok, 1 problems found / refused, 2 usage, 3 unreadable input, 4 a training run failed (a full
  disk included), 5 training was preempted (a stop signal saved a checkpoint; a rerun resumes), 130 Ctrl-C.
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

OK = 0
REFUSED = 1
USAGE = 2
BAD_INPUT = 3
RUN_FAILED = 4
PREEMPTED = 5
INTERRUPTED = 130

T = TypeVar("T")


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
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    body = Text(err.message)
    if err.hint:
        body.append("\n")
        body.append("hint: ", style="bold")
        body.append(err.hint)
    Console(stderr=True).print(
        Panel(body, title="[bold red]error[/]", title_align="left", border_style="red", expand=False)
    )


def run_cli(fn: Callable[[], T]) -> T:
    """Run `fn`; a LongspecError or Ctrl-C becomes a message and an exit code."""
    import typer

    try:
        return fn()
    except LongspecError as err:
        print_error(err)
        raise typer.Exit(err.exit_code) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise typer.Exit(INTERRUPTED) from None
    except OSError as e:
        from longspec_cli.core import diskspace

        if not diskspace.is_write_failure(e):
            raise
        # One of the CLI's own writes (run.json, train.log, a moved run folder) met a full disk.
        path = e.filename or "a file"
        print_error(RunFailed(f"could not write {path}: {e.strerror or e} "
                              f"({diskspace.human(diskspace.free_bytes(path if e.filename else '.'))} free)",
                              hint="free some space and run the command again"))
        raise typer.Exit(RUN_FAILED) from None
