"""Whether a process (or a run that run.json names) is alive: the one owner of that fact, on psutil.

A run is identified by pid AND start time (`proc_start` in run.json), so a reused pid is never
taken for the run. `proc_start` is the start time in clock ticks since boot (an int, as the kernel
keeps it), derived from psutil's create_time and boot_time read together, so it does not drift when
the wall clock is stepped; a float `proc_start` (seconds since the epoch) is still understood.

One rule for a run started on another host: its process cannot be checked from here
(`run_alive` returns None); each caller says what that means to its user. Pure: psutil only.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import psutil

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_DEAD = (psutil.STATUS_ZOMBIE, getattr(psutil, "STATUS_DEAD", "dead"))


def _process(pid: int) -> psutil.Process | None:
    """The live (not zombie) process `pid`, or None."""
    try:
        p = psutil.Process(int(pid))
        return None if p.status() in _DEAD else p
    except (psutil.Error, ValueError, OverflowError):
        return None


def proc_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when there is no such live process."""
    boot = psutil.boot_time()  # read first: create_time below uses this same boot time
    p = _process(pid)
    if p is None:
        return None
    try:
        return round((p.create_time() - boot) * _TICKS)
    except psutil.Error:
        return None


def pid_alive(pid: Any, proc_start: Any) -> bool:
    """True only if `pid` exists AND started at `proc_start` (so a reused pid is not the run)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    if isinstance(proc_start, bool) or not isinstance(proc_start, (int, float)):
        return False
    if isinstance(proc_start, int):
        return proc_start_time(pid) == proc_start
    p = _process(pid)
    try:
        return p is not None and abs(p.create_time() - proc_start) < 1e-3
    except psutil.Error:
        return False


def other_host(info: dict) -> str | None:
    """The host run.json names when it is not this one (its process cannot be checked from here)."""
    host = info.get("host")
    return host if host and host != socket.gethostname() else None


def run_alive(info: dict | None) -> bool | None:
    """Is the run that run.json describes alive? None when unknown: no run.json, or another host."""
    if info is None or other_host(info):
        return None
    return pid_alive(info.get("pid"), info.get("proc_start"))


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] not in _DEAD and os.getpgid(p.pid) == pgid:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def cmdline(pid: int) -> list[str]:
    """The process's argv; [] when it is gone (or not readable)."""
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.Error, ValueError):
        return []


def file_holders(path: str | os.PathLike) -> list[int]:
    """Live processes that hold `path` open (those this user may read: a file in the user's own
    cache is not held by another user's processes)."""
    return sorted(_holders([path]).get(os.path.realpath(path), ()))


def held_open(paths) -> set[str]:
    """The real paths among `paths` that some live process holds open: one pass over the
    processes for all of them."""
    return set(_holders(paths))


def _holders(paths) -> dict[str, set[int]]:
    targets = {os.path.realpath(p) for p in paths}
    found: dict[str, set[int]] = {}
    if not targets:
        return found
    for p in psutil.process_iter():
        try:
            for f in p.open_files():
                real = os.path.realpath(f.path)
                if real in targets:
                    found.setdefault(real, set()).add(p.pid)
        except psutil.Error:
            continue
    return found
