"""A run's process group: which members are training ranks, the save request, the stop escalation,
and `longspec stop` (a live run found through run.json, never a bare pid).

The launcher is started as its own group leader (launch/process.py), so the group holds every rank
and helper it spawns and nothing else. A save request is SIGTERM to the training ranks only (never to
DeepSpeed's launchers, which would kill the ranks 30 s later); stopping at once is SIGINT, SIGTERM,
then SIGKILL to the whole group until no member is left.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from longspec.machine import liveness
from longspec.runs import runrecord
from longspec.errors import RefusedError
from longspec_cli.launch.trainer import TRAINER_MODULE

GRACE_INT_S = 15.0  # after SIGINT: time for the ranks to unwind and the launcher to clean up
GRACE_TERM_S = 10.0  # after SIGTERM, before SIGKILL
SAVE_TIMEOUT_S = 600.0  # `stop`: how long the ranks may take to save before they are stopped anyway


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_trainer_rank(argv: list[str]) -> bool:
    """A training rank runs `python [-u] -m longspec.train ...` (or longspec/train.py); DeepSpeed's
    launchers carry `--module longspec.train` among their own flags, which is not this."""
    for i, arg in enumerate(argv[:4]):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == TRAINER_MODULE:
            return True
        if arg.endswith(("longspec/train.py", "longspec\\train.py")) and i <= 2:
            return True
    return False


def is_node_launcher(argv: list[str]) -> bool:
    """DeepSpeed's per-node launcher (`python -u -m deepspeed.launcher.launch ...`)."""
    return any(a == "-m" and i + 1 < len(argv) and argv[i + 1] == "deepspeed.launcher.launch"
               for i, a in enumerate(argv[:4]))


def trainer_ranks(pgid: int) -> list[int]:
    """The training ranks among the live members of process group `pgid`."""
    return [pid for pid in liveness.group_members(pgid) if is_trainer_rank(liveness.cmdline(pid))]


def request_save(pgid: int) -> list[int]:
    """SIGTERM to every training rank of the group: save a checkpoint, then exit. Returns the pids."""
    ranks = trainer_ranks(pgid)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    return ranks


def wait_group(pgid: int, timeout: float, reap: Callable[[], None] | None = None,
               skip: Callable[[], bool] | None = None, poll: float = 0.1) -> bool:
    """Wait until no process of the group is left; False on timeout (or when `skip` says so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reap:
            reap()
        if not liveness.group_members(pgid):
            return True
        if skip and skip():
            return False
        time.sleep(poll)
    return not liveness.group_members(pgid)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_group(pgid: int, *, grace_int: float = GRACE_INT_S, grace_term: float = GRACE_TERM_S,
                    reap: Callable[[], None] | None = None, skip: Callable[[], bool] | None = None,
                    say: Callable[[str], None] | None = None) -> str:
    """SIGINT, then SIGTERM, then SIGKILL the group until it is empty. Returns the last signal sent.

    reap: called while waiting (the parent must reap its child, or the leader stays a zombie).
    skip: returns True when the caller wants the next signal now (a second Ctrl-C).
    """
    last = "none"
    for sig, grace in ((signal.SIGINT, grace_int), (signal.SIGTERM, grace_term), (signal.SIGKILL, 5.0)):
        if reap:
            reap()
        if not liveness.group_members(pgid):
            return last
        if say and sig != signal.SIGINT:
            say(f"sending {signal.Signals(sig).name} to process group {pgid}")
        _signal_group(pgid, sig)
        last = signal.Signals(sig).name
        if wait_group(pgid, grace, reap, skip, poll=0.05):
            return last
    return last


# ---------------------------------------------------------------------------------------- stop

@dataclass
class StopOutcome:
    stage: str
    pid: int
    signal: str  # last signal sent, or "none"
    remaining: list[int]
    saved: bool = False  # the ranks saved a checkpoint and exited on their own


def live_run(output_dir: Path) -> dict | None:
    """run.json of a run that is still alive on this host, or None. Never trusts a bare pid."""
    info = runrecord.read(output_dir)
    if info is None:
        return None
    host = liveness.other_host(info)
    if host:
        raise RefusedError(f"{output_dir}: the run was started on host {host}",
                           hint=f"run `longspec stop` on {host}")
    if not liveness.run_alive(info):
        return None
    pgid = info.get("pgid")
    if not isinstance(pgid, int) or pgid != info.get("pid"):
        return None  # we always start the launcher as its own group leader
    return info


def stop_run(output_dir: Path, stage: str, *, grace_int: float = GRACE_INT_S,
             grace_term: float = GRACE_TERM_S, say: Callable[[str], None] | None = None,
             save: bool = True, save_timeout: float = SAVE_TIMEOUT_S) -> StopOutcome | None:
    """Stop the live run in `output_dir`; None when there is none (a stale run.json is left alone).

    save: SIGTERM to the training ranks first (they save a checkpoint and exit 5) and wait up to
    `save_timeout` for the group to end; then, or without save, SIGINT/SIGTERM/SIGKILL to the group."""
    info = live_run(output_dir)
    if info is None:
        return None
    pid = info["pid"]
    runrecord.update(output_dir, stop_requested_at=utc_now())
    if info.get("hosts") and info.get("run_id"):
        return _stop_nodes(info, stage, grace_int=grace_int, grace_term=grace_term, say=say, save=save,
                           save_timeout=save_timeout)
    # Between the check and the signal the group can only vanish, not be reused: a pgid is not
    # handed out again while a process of that group exists.
    if save and request_save(pid):
        if say:
            say(f"{stage}: the ranks finish their optimizer step and save a checkpoint "
                f"(up to {save_timeout:.0f} s; `longspec stop --now` stops without saving)")
        if wait_group(pid, save_timeout):
            return StopOutcome(stage=stage, pid=pid, signal="SIGTERM", remaining=[], saved=True)
    last = terminate_group(pid, grace_int=grace_int, grace_term=grace_term, say=say)
    return StopOutcome(stage=stage, pid=pid, signal=last, remaining=liveness.group_members(pid))


def _stop_nodes(info: dict, stage: str, *, grace_int: float, grace_term: float, say: Callable[[str], None] | None,
                save: bool, save_timeout: float) -> StopOutcome:
    """A run on several nodes: its leader (launch/fanout.py) passes the request on to every node and
    ends only once it has checked every host. SIGTERM: save, then stop; SIGUSR2: stop now."""
    pid, hosts = info["pid"], ", ".join(info["hosts"])
    if save:
        _signal(pid, signal.SIGTERM)
        if say:
            say(f"{stage}: every rank on {hosts} finishes its optimizer step and saves a checkpoint "
                f"(up to {save_timeout:.0f} s; `longspec stop --now` stops without saving)")
        if wait_group(pid, save_timeout):
            return StopOutcome(stage=stage, pid=pid, signal="SIGTERM", remaining=[], saved=True)
    elif say:
        say(f"{stage}: ending every rank on {hosts} now, without saving")
    _signal(pid, signal.SIGUSR2)
    if wait_group(pid, grace_int + grace_term + 60.0):  # the leader ends the ranks, then checks each host
        return StopOutcome(stage=stage, pid=pid, signal="SIGUSR2", remaining=[])
    last = terminate_group(pid, grace_int=grace_int, grace_term=grace_term, say=say)
    return StopOutcome(stage=stage, pid=pid, signal=last, remaining=liveness.group_members(pid))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
