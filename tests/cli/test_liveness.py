"""Process liveness (longspec/machine/liveness.py): pid + start time, so a reused pid is never the run; a run
on another host cannot be checked; a process group's live members."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from longspec.machine import liveness as L


def test_pid_alive_needs_the_same_start_time(tmp_path):
    me = os.getpid()
    start = L.proc_start_time(me)
    assert start is not None
    assert L.pid_alive(me, start)
    assert not L.pid_alive(me, start - 1 if isinstance(start, int) else start - 5.0)  # a reused pid
    assert not L.pid_alive(me, None)
    assert not L.pid_alive("123", start) and not L.pid_alive(True, start) and not L.pid_alive(-1, start)


def test_pid_alive_false_for_an_exited_process_and_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = L.proc_start_time(child.pid)
    deadline = time.time() + 20
    # not reaped yet: a zombie still has /proc/<pid>, but it is not a running training process
    while L.proc_start_time(child.pid) is not None and time.time() < deadline:
        time.sleep(0.02)
    assert not L.pid_alive(child.pid, start)
    child.wait()
    assert not L.pid_alive(child.pid, start)


def test_a_run_on_another_host_is_unknown_and_a_group_lists_its_members():
    me = os.getpid()
    info = {"pid": me, "proc_start": L.proc_start_time(me), "host": socket.gethostname()}
    assert L.run_alive(info) is True and L.other_host(info) is None
    assert L.run_alive({**info, "host": "elsewhere"}) is None and L.other_host({**info, "host": "elsewhere"}) == "elsewhere"
    assert L.run_alive(None) is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert L.group_members(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert L.group_members(child.pid) == []


def _baton_holder(lock, then: str) -> subprocess.Popen:
    """A process that takes `lock` as torch's extension builder does (FileBaton), then `then`."""
    code = ("import sys, time; from torch.utils.file_baton import FileBaton; "
            f"b = FileBaton({str(lock)!r}); assert b.try_acquire(); print('held', flush=True); {then}")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_lock_left_by_a_killed_op_build_is_removed_and_a_live_builds_is_kept(tmp_path, monkeypatch):
    """torch's extension builder holds <folder>/<op>/lock open while it compiles; killed midway it
    leaves the file, and every later build of the op waits for it forever. `doctor` names a lock
    no process holds, `run` removes it and says so; a live build's is left alone."""
    import io

    from torch.utils.file_baton import FileBaton

    from longspec.doctor import deepspeed_checks
    from longspec.machine import opsdir
    from longspec_cli.launch.execute import clear_stale_op_locks
    from longspec_cli.launch.plan import Console

    for op in ("live_op", "dead_op"):
        (tmp_path / op).mkdir()
    live = _baton_holder(tmp_path / "live_op" / "lock", "time.sleep(60)")
    dead = _baton_holder(tmp_path / "dead_op" / "lock", "time.sleep(60)")
    dead.kill()
    dead.wait()
    try:
        assert L.file_holders(tmp_path / "live_op" / "lock") == [live.pid]
        assert L.file_holders(tmp_path / "dead_op" / "lock") == []
        assert opsdir.stale_locks(tmp_path) == [tmp_path / "dead_op" / "lock"]
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        seen = {c["name"]: c for c in deepspeed_checks()}["op build locks"]
        assert seen["status"] == "warn" and "dead_op/lock" in seen["detail"] and "live_op" not in seen["detail"]
        out, err = io.StringIO(), io.StringIO()
        removed = clear_stale_op_locks(Console(out, err), folder=str(tmp_path))
        assert removed == [str(tmp_path / "dead_op" / "lock")]
        assert (tmp_path / "live_op" / "lock").exists()
        words = " ".join(err.getvalue().split())
        assert "dead_op op stopped midway" in words and "builds again" in words and "live_op" not in words
        assert FileBaton(str(tmp_path / "dead_op" / "lock")).try_acquire()     # the next build goes on
    finally:
        live.kill()
        live.wait()
