"""`python -m longspec.nodelaunch ARGS`: DeepSpeed's per-node launcher, patient with stop signals.

ARGS are those of `python -m deepspeed.launcher.launch` (--world_info, --node_rank, ...). DeepSpeed
0.19.8's launcher answers SIGINT/SIGTERM by terminating every rank (SIGTERM, then SIGKILL after
30 s) and dies of SIGUSR1 (no handler). A scheduler's preemption notice reaches the launcher and
the ranks together, and the ranks need time to save a checkpoint (longspec/preempt.py). Here the
first SIGTERM/SIGUSR1/SIGINT is passed on to the ranks once and otherwise ignored; the launcher
keeps waiting for them (they exit 5 after saving, and DeepSpeed's launcher exits with that code).
A second signal, later than the echo window, runs DeepSpeed's own handler: every rank ends now.

No window without a handler: the stop signals are blocked before anything is imported (importing
DeepSpeed takes seconds) and taken by one thread with sigwaitinfo(), as in the ranks. The ranks
inherit the blocked mask, so a signal that reaches a rank before its trainer installs its own
watcher (importing torch) stays pending until then instead of killing it; a request that came
before the ranks existed is passed to each rank as it starts.
"""
from __future__ import annotations

import signal

PATIENT = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
if hasattr(signal, "pthread_sigmask"):  # first thing: Python's start-up is the only window left
    signal.pthread_sigmask(signal.SIG_BLOCK, PATIENT)

import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from longspec.preempt import ECHO_S  # noqa: E402

LATE_RANKS_S = 600.0  # how long a request waits for ranks that have not started yet


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


class Patience:
    def __init__(self, shim: _SignalShim) -> None:
        self.shim = shim
        self.first: float | None = None
        self.signum = signal.SIGTERM
        self.told: set[int] = set()

    def on_signal(self, signum: int) -> None:
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
        ds_handler = self.shim.kept.get(signal.SIGTERM)
        if callable(ds_handler):
            try:
                ds_handler(signal.SIGTERM, None)   # terminates every rank's tree, then sys.exit(1)
            except SystemExit:
                pass
        _kill_children()
        os._exit(1)

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
    try:
        import psutil

        for p in psutil.Process().children(recursive=True):
            try:
                p.kill()
            except psutil.Error:
                pass
    except ImportError:
        pass


def main() -> None:
    shim = _SignalShim()
    patience = Patience(shim)
    if hasattr(signal, "sigwaitinfo"):
        def wait() -> None:
            while True:
                patience.on_signal(signal.sigwaitinfo(set(PATIENT)).si_signo)

        threading.Thread(target=wait, name="longspec-launcher-signals", daemon=True).start()
    else:  # no sigwaitinfo (not Linux): plain handlers in the main thread
        for sig in PATIENT:
            signal.signal(sig, lambda signo, frame: patience.on_signal(signo))
    from deepspeed.launcher import launch

    launch.signal = shim
    launch.main()


if __name__ == "__main__":
    main()
