"""Free space, failed writes and what a rerun resumes from: one wording for the trainer and the CLI.

A write that fails for want of space shows up as OSError ENOSPC/EDQUOT (Python writes), as a
RuntimeError from torch's C++ writer (`PytorchStreamWriter failed writing file`, `unexpected pos`,
`basic_ios::clear: iostream error`), which carries no errno, or as safetensors' SafetensorError
(`No space left on device (os error 28)`). `write_failure()` recognises both and words one message:
the path that could not be written, the free space left on its filesystem, and the newest complete
checkpoint (checkpoint.json present) that a rerun resumes from.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from longspec.runs import runfolder

_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# torch / DeepSpeed C++ writers: the message is all there is (no errno survives)
_WRITER_MESSAGES = ("No space left", "file write failed", "iostream error", "PytorchStreamWriter failed",
                    "unexpected pos", "Disk quota exceeded", "os error 28")


def human(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def existing_parent(path: str | os.PathLike) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes (for this user) on the filesystem that holds `path` or its nearest existing parent."""
    try:
        return shutil.disk_usage(existing_parent(path)).free
    except OSError:
        return None


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_write_failure(exc: BaseException) -> bool:
    """True for a failed write for want of space (or a C++ writer failure, which says no more)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS:
            return True
        if not isinstance(e, OSError) and any(m in str(e) for m in _WRITER_MESSAGES):
            return True
    return False


def failed_path(exc: BaseException) -> str | None:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
    return None


def resume_sentence(output_dir: str | os.PathLike) -> str:
    """Which complete checkpoint a rerun resumes from (or that it starts over)."""
    ckpts = runfolder.RunDir(output_dir).checkpoints()
    if not ckpts:
        return "no complete checkpoint yet: a rerun starts from step 0"
    last = ckpts[-1]
    return f"last complete checkpoint: {last.path} (step {last.step}); a rerun resumes from it"


def write_failure(path: str | os.PathLike, output_dir: str | os.PathLike, exc: BaseException | None = None) -> str:
    """The message for a write that failed: path, why, free space left, what a rerun resumes from."""
    free = free_bytes(path)
    reason = "no space left on the device"
    for e in _chain(exc) if exc is not None else ():
        if isinstance(e, OSError) and e.errno not in _SPACE_ERRNOS and e.strerror:
            reason = e.strerror
            break
    where = existing_parent(path)
    where = where.parent if where.is_file() else where
    return (f"could not write {path}: {reason} ({human(free)} free on {where})\n"
            f"{resume_sentence(output_dir)}")
