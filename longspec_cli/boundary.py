"""The one CLI error boundary: a LongspecError, Ctrl-C or a full disk becomes a message and an exit code.

Every verb's body runs inside `run_cli`; the errors and their codes are `longspec_cli.errors`.
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

from longspec_cli.errors import INTERRUPTED, RUN_FAILED, LongspecError, RunFailed, print_error

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
        from longspec_cli.core import diskspace

        if not diskspace.is_write_failure(e):
            raise
        # One of the CLI's own writes (run.json, train.log, a moved run folder) met a full disk.
        path = e.filename or "a file"
        print_error(RunFailed(f"could not write {path}: {e.strerror or e} "
                              f"({diskspace.human(diskspace.free_bytes(path if e.filename else '.'))} free)",
                              hint="free some space and run the command again"))
        raise typer.Exit(RUN_FAILED) from None
