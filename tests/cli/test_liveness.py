"""Process liveness (core/liveness.py): pid + start time, so a reused pid is never the run; a run
on another host cannot be checked; a process group's live members."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from longspec_cli.core import liveness as L


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
