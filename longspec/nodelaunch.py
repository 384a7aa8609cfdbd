"""`python -m longspec.nodelaunch [--control-stdin] ARGS`: DeepSpeed's per-node launcher, patient with
stop signals, that says how its ranks ended.

ARGS are those of `python -m deepspeed.launcher.launch` (--world_info, --node_rank, ...). DeepSpeed
0.19.8's launcher answers SIGINT/SIGTERM by terminating every rank (SIGTERM, then SIGKILL after
30 s) and dies of SIGUSR1 (no handler). A scheduler's preemption notice reaches the launcher and
the ranks together, and the ranks need time to save a checkpoint (longspec/preempt.py). Here the
first SIGTERM/SIGUSR1/SIGINT is passed on to the ranks once and otherwise ignored; the launcher
keeps waiting for them (they exit 5 after saving, and DeepSpeed's launcher exits with that code).
A second signal, later than the echo window, runs DeepSpeed's own handler: every rank ends now.

When it ends, one line `LONGSPEC-NODE {json}` on stdout: the node rank, this host, the exit code and
each rank's pid and return code, and the rank that failed first (`first_failed`), so that the
launching host can name the rank and the signal (`run --hostfile`, longspec_cli/launch/fanout.py).

--control-stdin (a launch over ssh): stdin is a control channel from the launching host. A line
`save` is a stop request (as the first signal: the ranks save a checkpoint and exit); `kill` ends
every rank now (SIGKILL to each rank's tree); end of file (the launching host or its ssh is gone)
is a save request, so a lost launcher never leaves ranks training with nobody to report to.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

from longspec.preempt import ECHO_S

PATIENT = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
MARK = "LONGSPEC-NODE "
POLL_S = 0.1


class _SignalShim:
    """Stands in for the `signal` module inside deepspeed.launcher.launch: its handlers are kept
    for the second signal, ours is installed."""

    def __init__(self, patient) -> None:
        self.kept: dict[int, object] = {}
        self._patient = patient

    def __getattr__(self, name: str):
        return getattr(signal, name)

    def signal(self, sig, handler):
        if sig in PATIENT:
            self.kept[sig] = handler
            return signal.signal(sig, self._patient)
        return signal.signal(sig, handler)


class _Ranks:
    """Stands in for the `subprocess` module inside deepspeed.launcher.launch: records each rank it
    starts (with its RANK) and gives the ranks no stdin (the launcher's may be a control channel)."""

    def __init__(self) -> None:
        import subprocess

        self._sp = subprocess
        self.procs: list[tuple[int, object]] = []  # (global rank, Popen)
        self.ended: list[tuple[float, int, int]] = []  # (time, rank, returncode) in the order seen

    def __getattr__(self, name: str):
        return getattr(self._sp, name)

    def Popen(self, cmd, *args, **kwargs):  # noqa: N802 - the name DeepSpeed calls
        kwargs.setdefault("stdin", self._sp.DEVNULL)
        proc = self._sp.Popen(cmd, *args, **kwargs)
        env = kwargs.get("env") or os.environ
        try:
            rank = int(env.get("RANK", "-1"))
        except ValueError:
            rank = -1
        self.procs.append((rank, proc))
        return proc

    def watch(self) -> None:
        """Note the order in which ranks end (DeepSpeed's own loop looks once a second)."""
        seen: set[int] = set()
        while True:
            for rank, proc in list(self.procs):
                if id(proc) not in seen and proc.poll() is not None:
                    seen.add(id(proc))
                    self.ended.append((time.time(), rank, proc.returncode))
            time.sleep(POLL_S)

    def report(self, node_rank: int | None, code: int) -> dict:
        failed = [(t, r, rc) for t, r, rc in self.ended if rc != 0]
        first = min(failed, key=lambda x: x[0]) if failed else None
        return {"node": node_rank, "host": socket.gethostname(), "code": code,
                "ranks": [{"rank": r, "pid": p.pid, "returncode": p.poll()} for r, p in self.procs],
                "first_failed": None if first is None else {"rank": first[1], "returncode": first[2]}}


def main() -> None:
    from deepspeed.launcher import launch

    argv = sys.argv[1:]
    control = "--control-stdin" in argv
    sys.argv = [sys.argv[0]] + [a for a in argv if a != "--control-stdin"]
    node_rank = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--node_rank=")), None)
    first: list[float] = []
    ranks = _Ranks()

    def patient(signum, frame) -> None:
        now = time.monotonic()
        if not first:
            first.append(now)
            print(f"[launcher] {signal.Signals(signum).name}: the ranks save a checkpoint and exit; "
                  "send it again to end them at once", file=sys.stderr, flush=True)
            _forward(signum)
            return
        if now - first[0] < ECHO_S:
            return
        ds_handler = shim.kept.get(signal.SIGTERM)
        if callable(ds_handler):
            ds_handler(signal.SIGTERM, frame)   # terminates every rank's tree, then exits
        sys.exit(1)

    shim = _SignalShim(patient)
    launch.signal = shim
    launch.subprocess = ranks
    signal.signal(signal.SIGUSR1, patient)
    threading.Thread(target=ranks.watch, name="longspec-ranks", daemon=True).start()
    if control:
        threading.Thread(target=_control, args=(first,), name="longspec-control", daemon=True).start()
    code = 1  # an exception out of DeepSpeed's launcher
    try:
        launch.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - said here: the exit below skips the interpreter's own report
        import traceback

        traceback.print_exc()
    finally:
        time.sleep(2 * POLL_S)  # the watcher notes the last rank's end
        try:
            print(MARK + json.dumps(ranks.report(node_rank, code & 0xFF if code < 0 else code)), flush=True)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        # Everything is said and the ranks are gone: skip the interpreter's teardown of the native
        # thread pools that importing DeepSpeed started (seconds), which would delay the report.
        os._exit(code & 0xFF)


def _control(first: list[float]) -> None:
    """Read the launching host's requests on stdin (see the module docstring). A save request is
    the first stop signal, raised here so that the main thread's handler takes it; after a first
    one (a scheduler's, on this node) it is the same request, not a second."""
    while True:
        try:
            line = sys.stdin.readline()
        except (OSError, ValueError):
            line = ""
        word = line.strip()
        if not line:   # EOF: the launching host or its connection is gone
            print("[launcher] the launching host is gone: the ranks save a checkpoint and exit",
                  file=sys.stderr, flush=True)
            if not first:
                signal.raise_signal(signal.SIGTERM)
            return
        if word == "save" and not first:
            signal.raise_signal(signal.SIGTERM)
        elif word == "kill":
            print("[launcher] ending every rank now (no checkpoint)", file=sys.stderr, flush=True)
            _kill_ranks()


def _forward(signum: int) -> None:
    """Pass the request to the ranks (the launcher's children); a rank that got it directly too
    counts the copy from its parent as the same request."""
    try:
        import psutil

        for child in psutil.Process().children():
            try:
                child.send_signal(signum if signum != signal.SIGINT else signal.SIGTERM)
            except psutil.Error:
                pass
    except ImportError:
        pass


def _kill_ranks() -> None:
    """SIGKILL every process under this launcher (the ranks and what they started)."""
    import psutil

    procs = psutil.Process().children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    main()
