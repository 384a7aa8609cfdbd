"""The one CLI error boundary: a LongspecError, Ctrl-C or a full disk becomes a message and an exit code.

Every verb's body runs inside `run_cli`; the errors and their codes are `longspec.errors`.
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

from longspec.errors import INTERRUPTED, RUN_FAILED, LongspecError, RunFailed

T = TypeVar("T")


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
        from longspec.runs import diskspace

        if not diskspace.is_write_failure(e):
            raise
        # One of the CLI's own writes (run.json, train.log, a moved run folder) met a full disk.
        path = e.filename or "a file"
        print_error(RunFailed(f"could not write {path}: {e.strerror or e} "
                              f"({diskspace.human(diskspace.free_bytes(path if e.filename else '.'))} free)",
                              hint="free some space and run the command again"))
        raise typer.Exit(RUN_FAILED) from None


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
