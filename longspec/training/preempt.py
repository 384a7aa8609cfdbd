"""Stop signals for a training rank: SIGTERM / SIGUSR1 ask for a checkpoint, a second one ends it now.

What schedulers and launchers send, and why the watcher works as it does:
- SLURM (`--signal`, preemption, `scancel`) signals every process of a job step: the per-node
  launcher and every rank. DeepSpeed 0.19.8's per-node launcher (deepspeed/launcher/launch.py)
  answers SIGINT/SIGTERM by sending SIGTERM to each rank's process tree, waiting 30 s, then SIGKILL;
  its runner (`deepspeed`, single node) installs no handler and dies of SIGTERM at once. So one
  request can reach a rank twice within milliseconds: once directly and once forwarded by its
  parent. A repeat from the launcher (the parent) or the first sender within ECHO_S counts as the
  same request; any later one is a second signal and ends the rank at once (os._exit), even while
  the main thread is stuck in a collective or a write.
- The signals are blocked in every thread and taken by one thread with sigwaitinfo(), which says
  who sent them (a Python handler would not) and runs while the main thread is inside C++ code.
- `longspec stop` and Ctrl-C in `longspec run` signal the ranks only (not the launchers); the
  per-node launcher in the sbatch script (`python -m longspec.nodelaunch`) ignores the first
  request so it neither kills the ranks after 30 s nor dies of SIGUSR1.

The training loop reads `requested` at each optimizer-step boundary (all ranks agree through the
step's all-reduce), saves a checkpoint on every rank, writes a `preempted` event and exits
EXIT_PREEMPTED.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

EXIT_PREEMPTED = 5          # a stop signal saved a checkpoint and ended training; a rerun resumes
EXIT_INTERRUPTED = 130
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
ECHO_S = 2.0                # a forwarded copy of the same request arrives within this


class StopWatch:
    def __init__(self) -> None:
        self.requested = threading.Event()
        self.name: str | None = None          # SIGTERM / SIGUSR1
        self.saved = False                    # the checkpoint of the request is on disk
        self._first: tuple[float, int] | None = None    # (monotonic time, sender pid)

    def install(self) -> None:
        """Block the stop signals in this (main) thread before any other thread exists, and take
        them in a daemon thread. Without sigwaitinfo (not Linux): plain handlers in the main thread."""
        if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            threading.Thread(target=self._wait, name="longspec-stop-signals", daemon=True).start()
        else:
            for sig in STOP_SIGNALS:
                signal.signal(sig, lambda signo, frame: self.on_signal(signo, -1))

    def _wait(self) -> None:
        while True:
            info = signal.sigwaitinfo(set(STOP_SIGNALS))
            self.on_signal(info.si_signo, info.si_pid)

    def on_signal(self, signo: int, sender: int) -> None:
        now, rank = time.monotonic(), os.environ.get("RANK", "0")
        name = signal.Signals(signo).name
        if self._first is None:
            self._first, self.name = (now, sender), name
            self.requested.set()
            _say(f"[rank {rank}] {name} received: finishing this optimizer step, saving a checkpoint, "
                 f"then exiting (send it again to exit at once, without saving)")
            return
        t0, first_sender = self._first
        if now - t0 < ECHO_S and sender in (first_sender, os.getppid(), -1):
            return                                       # the same request, forwarded
        code = EXIT_PREEMPTED if self.saved else EXIT_INTERRUPTED
        _say(f"[rank {rank}] second stop signal ({name}): exiting now"
             + ("" if self.saved else ", without saving a checkpoint"))
        os._exit(code)


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


WATCH = StopWatch()
