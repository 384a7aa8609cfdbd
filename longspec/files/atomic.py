"""Atomic writes, hashing and locking: a file is either the old or the new one, never half."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same folder, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    # newline="" semantics: the caller's line endings are written as given.
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_stamped_json(path: str | os.PathLike, fmt: Any) -> dict | None:
    """The JSON object in `path` when its "format" field is `fmt`; None when the file is missing or
    unreadable, not a JSON object, or of another format (a reader of a newer or older layout)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == fmt else None


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder by name (a folder: so a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems refuse a folder fsync: the rename stands
        fsync_path(folder)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Path:
    """longspec's one cache folder: $LONGSPEC_CACHE_DIR, else $XDG_CACHE_HOME/longspec, else ~/.cache/longspec."""
    return Path(os.environ.get("LONGSPEC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "longspec"))


def lock_path(path: str | os.PathLike) -> Path:
    """Where the lock for `path` lives: a cache folder, so no `.lock` file clutters the config tree."""
    base = cache_root() / "locks"
    base.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:24]
    return base / f"{Path(path).name}.{key}.lock"


@contextlib.contextmanager
def locked(path: str | os.PathLike, timeout: float = 30.0) -> Iterator[None]:
    """Hold a lock on `path` (by its resolved name) around a read-modify-write of it."""
    from filelock import FileLock, Timeout

    from longspec.errors import RefusedError

    lock = FileLock(str(lock_path(path)))
    try:
        with lock.acquire(timeout=timeout):
            yield
    except Timeout:
        raise RefusedError(
            f"{path} is locked by another longspec process",
            hint=f"wait for it to finish, or remove {lock_path(path)} if no longspec process is running",
        ) from None


def cache_get(name: str, key: str) -> Any:
    """The value stored under `key` in the cache file `name` (under cache_root()), or None."""
    try:
        cache = json.loads((cache_root() / name).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return cache.get(key) if isinstance(cache, dict) else None


def cache_put(name: str, key: str, value: Any, keep: int) -> None:
    """Store `key` -> `value` in the cache file `name`, keeping the newest `keep` entries. The
    read-modify-write holds the file's lock; a read-only or busy cache is skipped (computed again next time)."""
    from longspec.errors import RefusedError

    path = cache_root() / name
    try:
        with locked(path, timeout=5.0):
            try:
                cache = json.loads(path.read_bytes())
            except (OSError, ValueError, RecursionError):
                cache = {}
            cache = cache if isinstance(cache, dict) else {}
            cache.pop(key, None)  # re-inserted last: the newest entry
            cache[key] = value
            atomic_write_json(path, dict(list(cache.items())[-keep:]))
    except (OSError, RefusedError):
        pass


def entry_get(folder: str, key: str) -> Any:
    """The JSON value of the cache entry `key` (a file name, e.g. a hex digest) in the cache folder
    `folder` under cache_root(), or None. One file per entry: no reader ever parses the others."""
    try:
        return json.loads((cache_root() / folder / f"{key}.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


def entry_put(folder: str, key: str, value: Any, keep: int) -> None:
    """Write the cache entry `key` atomically (a whole-file replace, so no read-modify-write and no
    lock); past `keep` entries, the folder's lock is taken to remove the oldest. A read-only, full or
    busy cache is skipped: the value is computed again next time."""
    from longspec.errors import RefusedError

    base = cache_root() / folder
    try:
        atomic_write_text(base / f"{key}.json", json.dumps(value, separators=(",", ":")))
        entries = list(base.glob("*.json"))
        if len(entries) <= keep:
            return
        with locked(base, timeout=1.0):
            entries = sorted(base.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
            for old in entries[:-keep]:
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()
    except (OSError, RefusedError):
        pass
