"""Where DeepSpeed's JIT-built ops live for longspec's launches, and the locks stopped builds left.

torch's extension builder (which DeepSpeed's op builders call) holds `<folder>/<op>/lock` open
while it compiles and deletes it when done. A build killed midway (Ctrl-C in a stage's first
minute, a node's time limit) leaves the file, and every later build of that op waits for it
forever, silently. A lock no live process holds open is such a leftover. `longspec run` removes
them before it launches; `longspec doctor` names them.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

from longspec.machine.liveness import held_open


def ops_build_dir() -> str:
    """TORCH_EXTENSIONS_DIR for the launches: one folder per Python environment, beside torch's own.

    DeepSpeed JIT-builds its CPU ops (cpu_adam, the shm comm op) into torch's extension folder,
    which every environment of a user shares: two environments (two checkouts, two venvs)
    alternating on one machine rebuild each other's ops, about two minutes per launch here."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env_id = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return os.path.join(cache, "torch_extensions", f"longspec-{env_id}")


def launch_folder() -> str:
    """The folder a launch from this environment builds into: TORCH_EXTENSIONS_DIR if set, else ours."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or ops_build_dir()


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def stale_locks(folder: str | os.PathLike, settle: float = 0.5) -> list[Path]:
    """The op locks under `folder` that no process holds open, and still the same file `settle`
    seconds later (a build that just ended closes its lock, then deletes it)."""
    locks = sorted(Path(folder).glob("*/lock"))
    if not locks:
        return []
    held = held_open(locks)
    first = {lock: _inode(lock) for lock in locks if os.path.realpath(lock) not in held}
    if not first:
        return []
    time.sleep(settle)
    held = held_open(first)
    return [lock for lock, inode in first.items()
            if inode is not None and _inode(lock) == inode and os.path.realpath(lock) not in held]
