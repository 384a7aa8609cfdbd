"""`python -m longspec.nodelaunch [--control-stdin] ARGS`: DeepSpeed's per-node launcher, patient with
stop signals, that says how its ranks ended.

ARGS are those of `python -m deepspeed.launcher.launch` (--world_info, --node_rank, ...). DeepSpeed
0.19.8's launcher answers SIGINT/SIGTERM by terminating every rank (SIGTERM, then SIGKILL after
30 s) and dies of SIGUSR1 (no handler). A scheduler's preemption notice reaches the launcher and
the ranks together, and the ranks need time to save a checkpoint (longspec/training/preempt.py). Here the
first SIGTERM/SIGUSR1/SIGINT is passed on to the ranks once and otherwise ignored; the launcher
keeps waiting for them (they exit 5 after saving, and DeepSpeed's launcher exits with that code).
A second signal, later than the echo window, runs DeepSpeed's own handler: every rank ends now.

No window without a handler: the stop signals are blocked before anything is imported (importing
DeepSpeed takes seconds) and taken by one thread with sigwaitinfo(), as in the ranks. The ranks
inherit the blocked mask, so a signal that reaches a rank before its trainer installs its own
watcher (importing torch) stays pending until then instead of killing it; a request that came
before the ranks existed is passed to each rank as it starts.

When it ends, one line `LONGSPEC-NODE {json}` on stdout: the node rank, this host, the exit code and
each rank's pid and return code, and the rank that failed first (`first_failed`), so that the
launching host can name the rank and the signal (`run --hostfile`, longspec_cli/launch/fanout.py).

--control-stdin (a launch over ssh): stdin is a control channel from the launching host. A line
`save` is a stop request (as the first signal: the ranks save a checkpoint and exit); `kill` ends
every rank now (SIGKILL to each rank's tree); end of file (the launching host or its ssh is gone)
is a save request, so a lost launcher never leaves ranks training with nobody to report to.
"""
from __future__ import annotations

import signal

PATIENT = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
if hasattr(signal, "pthread_sigmask"):  # first thing: Python's start-up is the only window left
    signal.pthread_sigmask(signal.SIG_BLOCK, PATIENT)

import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from longspec.training.preempt import ECHO_S  # noqa: E402

LATE_RANKS_S = 600.0  # how long a request waits for ranks that have not started yet
MARK = "LONGSPEC-NODE "
POLL_S = 0.1


class _SignalShim:
    """Stands in for the `signal` module inside deepspeed.launcher.launch: its handlers are kept
    for the second signal, not installed."""

    def __init__(self) -> None:
        self.kept: dict[int, object] = {}

    def __getattr__(self, name: str):
        return getattr(signal, name)

    def signal(self, sig, handler):
        if sig in PATIENT:
            self.kept[sig] = handler
            return signal.SIG_DFL
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


class Patience:
    """The first stop request is passed to the ranks (and to ranks that start later); a second one,
    after the echo window, ends every rank now. Signals and the control channel both come here."""

    def __init__(self, shim: _SignalShim, finish) -> None:
        self.shim = shim
        self.finish = finish  # finish(code): report and exit the process
        self.first: float | None = None
        self.signum = signal.SIGTERM
        self.told: set[int] = set()
        self._lock = threading.Lock()

    def on_signal(self, signum: int) -> None:
        with self._lock:
            now = time.monotonic()
            if self.first is None:
                self.first, self.signum = now, signum
                print(f"[launcher] {signal.Signals(signum).name}: the ranks save a checkpoint and exit; "
                      "send it again to end them at once", file=sys.stderr, flush=True)
                self.forward()
                threading.Thread(target=self._late_ranks, name="longspec-late-ranks", daemon=True).start()
                return
            if now - self.first < ECHO_S:
                return
        print(f"[launcher] second stop signal ({signal.Signals(signum).name}): ending every rank now",
              file=sys.stderr, flush=True)
        self.kill()

    def kill(self) -> None:
        ds_handler = self.shim.kept.get(signal.SIGTERM)
        if callable(ds_handler):
            try:
                ds_handler(signal.SIGTERM, None)   # terminates every rank's tree, then sys.exit(1)
            except SystemExit:
                pass
        _kill_children()
        self.finish(1)

    def forward(self) -> None:
        """Pass the request to the ranks (the launcher's children) not yet told; a rank that got it
        directly too counts the copy from its parent as the same request."""
        sig = self.signum if self.signum != signal.SIGINT else signal.SIGTERM
        for child in _children():
            if child.pid in self.told:
                continue
            self.told.add(child.pid)
            try:
                child.send_signal(sig)
            except Exception:
                pass

    def _late_ranks(self) -> None:
        deadline = time.monotonic() + LATE_RANKS_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
            self.forward()


def _children() -> list:
    try:
        import psutil

        return psutil.Process().children()
    except Exception:
        return []


def _kill_children() -> None:
    """SIGKILL every process under this launcher (the ranks and what they started)."""
    try:
        import psutil

        for p in psutil.Process().children(recursive=True):
            try:
                p.kill()
            except psutil.Error:
                pass
    except ImportError:
        pass


def _control(patience: Patience) -> None:
    """Read the launching host's requests on stdin (see the module docstring). A save request is
    the first stop request; after a first one (a scheduler's, on this node) it is the same request."""
    while True:
        try:
            line = sys.stdin.readline()
        except (OSError, ValueError):
            line = ""
        word = line.strip()
        if not line:   # EOF: the launching host or its connection is gone
            print("[launcher] the launching host is gone: the ranks save a checkpoint and exit",
                  file=sys.stderr, flush=True)
            if patience.first is None:
                patience.on_signal(signal.SIGTERM)
            return
        if word == "save" and patience.first is None:
            patience.on_signal(signal.SIGTERM)
        elif word == "kill":
            print("[launcher] ending every rank now (no checkpoint)", file=sys.stderr, flush=True)
            _kill_children()


def main() -> None:
    argv = sys.argv[1:]
    control = "--control-stdin" in argv
    sys.argv = [sys.argv[0]] + [a for a in argv if a != "--control-stdin"]
    node_rank = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--node_rank=")), None)
    ranks = _Ranks()

    def finish(code: int) -> None:
        time.sleep(2 * POLL_S)  # the watcher notes the last rank's end
        try:
            print(MARK + json.dumps(ranks.report(node_rank, code & 0xFF if code < 0 else code)), flush=True)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        # Everything is said and the ranks are gone: skip the interpreter's teardown of the native
        # thread pools that importing DeepSpeed started (seconds), which would delay the report.
        os._exit(code & 0xFF)

    shim = _SignalShim()
    patience = Patience(shim, finish)
    if hasattr(signal, "sigwaitinfo"):
        def wait() -> None:
            while True:
                patience.on_signal(signal.sigwaitinfo(set(PATIENT)).si_signo)

        threading.Thread(target=wait, name="longspec-launcher-signals", daemon=True).start()
    else:  # no sigwaitinfo (not Linux): plain handlers in the main thread
        for sig in PATIENT:
            signal.signal(sig, lambda signo, frame: patience.on_signal(signo))
    if control:
        threading.Thread(target=_control, args=(patience,), name="longspec-control", daemon=True).start()
    from deepspeed.launcher import launch

    launch.signal = shim
    launch.subprocess = ranks
    threading.Thread(target=ranks.watch, name="longspec-ranks", daemon=True).start()
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
        finish(code)


if __name__ == "__main__":
    main()
