"""`python -m longspec.nodectl COMMAND ...`: one multi-node run's processes on this host.

`longspec run --hostfile` starts each node's launcher over ssh with LONGSPEC_RUN_ID=<id> in its
environment (longspec_cli/launch/nodes.py); every rank and every helper a rank starts inherits it.
The launching host asks each node over ssh, one short command at a time:

    probe [--port P | --pick-port] [--addr]   reachable, this Python runs, cores; on node 0 the
                                                master port (P checked free, or a free one picked)
                                                and the node's first address (`hostname -I`)
    list RUN_ID                                 this run's processes here
    end RUN_ID [--wait S] [--signal SIG]        (SIG to this run's ranks first), wait up to S seconds
                                                for its processes to end, then SIGKILL what is left

Each prints one JSON line. Only processes whose environment carries exactly this run's id are
looked at, so another run here (even one started from the same Python) is never touched; DeepSpeed's
own runner ends a run with `pkill -f "<python> -u -m deepspeed.launcher.launch"` on every host,
which reaches every run of that Python. Pure: psutil and the standard library.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

RUN_ID_ENV = "LONGSPEC_RUN_ID"
NODE_LAUNCHER = "longspec.nodelaunch"


def run_processes(run_id: str) -> list:
    """The live processes of this host whose environment names `run_id` (never this one)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.environ().get(RUN_ID_ENV) == run_id:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def describe(procs) -> list[dict]:
    rows = []
    for p in procs:
        try:
            rows.append({"pid": p.pid, "cmd": " ".join(p.cmdline())[:200], "rank": p.environ().get("RANK")})
        except Exception:  # noqa: BLE001 - gone between the listing and now
            continue
    return rows


def ranks(procs) -> list:
    """The training ranks among `procs`: the children of the run's node launcher(s)."""
    launchers = []
    for p in procs:
        try:
            cmd = p.cmdline()
        except Exception:  # noqa: BLE001
            continue
        if any(a == "-m" and i + 1 < len(cmd) and cmd[i + 1] == NODE_LAUNCHER for i, a in enumerate(cmd[:4])):
            launchers.append(p.pid)
    out = []
    for p in procs:
        try:
            if p.ppid() in launchers:
                out.append(p)
        except Exception:  # noqa: BLE001
            continue
    return out


def end(run_id: str, wait: float, sig: int | None = None) -> dict:
    """(sig to the ranks,) wait for the run's processes here to end, then SIGKILL the rest."""
    import psutil

    procs = run_processes(run_id)
    if sig is not None:
        for p in ranks(procs):
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
    deadline = time.monotonic() + wait
    while procs and time.monotonic() < deadline:
        time.sleep(0.1)
        procs = run_processes(run_id)
    killed = describe(procs)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    if procs:
        psutil.wait_procs(procs, timeout=5)
    left = describe(run_processes(run_id))
    return {"host": socket.gethostname(), "killed": killed, "left": left}


def probe(port: int | None, pick: bool, addr: bool) -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out: dict = {"host": socket.gethostname(), "python": sys.executable, "cores": cores}
    if pick:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            out["port"], out["port_free"] = s.getsockname()[1], True
    elif port is not None:
        out["port"], out["port_free"] = port, port_free(port)
    if addr:
        try:
            words = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
        except (OSError, subprocess.SubprocessError):
            words = []
        out["addr"] = words[0] if words else None
    return out


def port_free(port: int) -> bool:
    """Can a rendezvous server listen on `port` here (every address, as torch's TCPStore does)?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen(1)
        except OSError:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m longspec.nodectl")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--port", type=int)
    p.add_argument("--pick-port", action="store_true")
    p.add_argument("--addr", action="store_true")
    p = sub.add_parser("list")
    p.add_argument("run_id")
    p = sub.add_parser("end")
    p.add_argument("run_id")
    p.add_argument("--wait", type=float, default=0.0)
    p.add_argument("--signal", default=None, help="e.g. SIGTERM: sent to the ranks first")
    a = ap.parse_args(argv)
    if a.command == "probe":
        res = probe(a.port, a.pick_port, a.addr)
    elif a.command == "list":
        res = {"host": socket.gethostname(), "left": describe(run_processes(a.run_id))}
    else:
        sig = getattr(signal, a.signal) if a.signal else None
        res = end(a.run_id, a.wait, sig)
    print(json.dumps(res), flush=True)
    return 1 if res.get("left") else 0


if __name__ == "__main__":
    sys.exit(main())
