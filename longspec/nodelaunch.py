"""`python -m longspec.nodelaunch ARGS`: DeepSpeed's per-node launcher, patient with stop signals.

ARGS are those of `python -m deepspeed.launcher.launch` (--world_info, --node_rank, ...). DeepSpeed
0.19.8's launcher answers SIGINT/SIGTERM by terminating every rank (SIGTERM, then SIGKILL after
30 s) and dies of SIGUSR1 (no handler). A scheduler's preemption notice reaches the launcher and
the ranks together, and the ranks need time to save a checkpoint (longspec/preempt.py). Here the
first SIGTERM/SIGUSR1/SIGINT is passed on to the ranks once and otherwise ignored; the launcher
keeps waiting for them (they exit 5 after saving, and DeepSpeed's launcher exits with that code).
A second signal, later than the echo window, runs DeepSpeed's own handler: every rank ends now.
"""
from __future__ import annotations

import signal
import sys
import time

from longspec.preempt import ECHO_S

PATIENT = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


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


def main() -> None:
    from deepspeed.launcher import launch

    first: list[float] = []

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
    signal.signal(signal.SIGUSR1, patient)
    launch.main()


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


if __name__ == "__main__":
    main()
