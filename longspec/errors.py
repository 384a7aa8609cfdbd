"""Typed errors and their exit codes (the ground floor: imports nothing of longspec; the front
end's `longspec_cli.boundary.run_cli` prints them as one red panel and exits with the code).

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
