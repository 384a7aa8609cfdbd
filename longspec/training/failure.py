"""The training run's error boundary: a user's mistake or a full disk becomes one `error:` block on
stderr, an `error` event in metrics.jsonl and exit 1; a bug keeps its traceback. A write that failed
for want of space also drops the half-written checkpoint and names the checkpoint a rerun resumes
from (longspec.runs.diskspace words it)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from longspec.training import dsconfig, runwriter
from longspec.training.rank import progress, rank
from longspec.training.entry import EXIT_ERROR, report_error, user_errors
from longspec.training.preempt import EXIT_INTERRUPTED


def guarded(run: Callable[[object], int], cfg) -> int:
    """run() with the error boundary: user mistakes -> one `error:` block, exit 1, no traceback."""
    from longspec.runs import diskspace

    try:
        return run(cfg)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:
        if isinstance(e, dsconfig.ConfigError):
            message = "invalid stage config:\n" + "\n".join(f"- {p}" for p in e.problems)
        elif isinstance(e, user_errors()):
            message = str(e)
        elif diskspace.is_write_failure(e):
            message = _write_failure(cfg, e)
        else:
            import traceback

            traceback.print_exc()
            message = f"training failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if rank() == 0:
            report_error(message)
            _error_event(cfg, message)
        return EXIT_ERROR


def _error_event(cfg, message: str) -> None:
    try:
        out_dir = Path(cfg.get("output_dir"))
    except Exception:
        return
    if out_dir.is_dir():
        try:
            runwriter.RunWriter(out_dir).event("error", progress["step"], message=message)
        except OSError:
            pass                       # a full disk: the error block on stderr says it all


def _write_failure(cfg, e: BaseException) -> str:
    """A write failed for want of space: drop the half-written checkpoint (rank 0; it never got its
    checkpoint.json, so nothing reads it, but it holds space), then name path, space and resume point."""
    from longspec.runs import diskspace

    try:
        out_dir = Path(cfg.get("output_dir"))
    except Exception:
        out_dir = Path(".")
    path = progress["writing"] or diskspace.failed_path(e) or "the training log (stdout)"
    if rank() == 0:
        runwriter.RunWriter(out_dir).drop_incomplete_checkpoints()
    return diskspace.write_failure(path, out_dir, e)
