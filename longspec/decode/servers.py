"""Which of regeneration's OpenAI-compatible servers are in the rotation (longspec.decode.engines
ServerEngine asks them; `python -m longspec.regenerate` stops when none is left).

A server that gives no answer (a refused or reset connection, a timeout) leaves the rotation, said
once on stderr; the request goes to another server. A prober thread asks each server out of the
rotation for /v1/models every `probe_every` seconds and puts it back when it answers (said once).
When every server has been out of the rotation for `wait` seconds, `acquire` raises ServersGone in
every thread that asks for one: the run stops, keeps the rows done, and a rerun goes on.

No answer is not a row's failure: the row is asked again, elsewhere or later. A server that answers,
even with an error, is in the rotation (the engine judges the error).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable


class ServerUnreachable(Exception):
    """A request that got no answer from its server (refused, reset, timed out)."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")
        self.url, self.reason = url, reason


class ServersGone(Exception):
    """No server answered for the rotation's `wait` seconds."""


def say(text: str) -> None:
    print(f"regenerate: {text}", file=sys.stderr, flush=True)


class Rotation:
    """`concurrency` request slots per server, handed out round robin among the servers that answer."""

    def __init__(self, urls: list[str], concurrency: int, wait: float, probe: Callable[[str], None],
                 probe_every: float = 1.0, tell: Callable[[str], None] = say):
        self.urls, self.wait, self.probe, self.probe_every, self.tell = urls, wait, probe, probe_every, tell
        self.slots = [threading.BoundedSemaphore(concurrency) for _ in urls]
        self.up = [True] * len(urls)
        self.gone = False                    # the run's stop: no server answered for `wait` seconds
        self.all_down_since: float | None = None
        self._turn = 0
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)   # a slot released or a server back: look again
        self._closed = threading.Event()
        self._prober: threading.Thread | None = None

    def acquire(self) -> int:
        """A server with a free slot, round robin among those up (blocks while all are busy);
        ServersGone once none has been up for `wait` seconds."""
        with self._freed:
            while True:
                if self.gone:
                    raise ServersGone(self.gone_message())
                if self.all_down_since is not None and time.monotonic() - self.all_down_since >= self.wait:
                    self.gone = True
                    self._freed.notify_all()
                    raise ServersGone(self.gone_message())
                n = len(self.urls)
                for k in range(n):
                    i = (self._turn + k) % n
                    if self.up[i] and self.slots[i].acquire(blocking=False):
                        self._turn = i + 1
                        return i
                # asleep until a slot frees or a server comes back; awake now and then for the bound
                self._freed.wait(0.1 if self.all_down_since is not None else 1.0)

    def release(self, i: int) -> None:
        with self._freed:
            self.slots[i].release()
            self._freed.notify_all()

    def down(self, i: int, reason: str) -> None:
        """Server i gave no answer: out of the rotation (said once), probed until it answers."""
        with self._lock:
            if not self.up[i]:
                return
            self.up[i] = False
            others = sum(self.up)
            if not others:
                self.all_down_since = time.monotonic()
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe_loop, name="regen-probe", daemon=True)
                self._prober.start()
        where = (f"its requests go to the {others} other server{'s' if others > 1 else ''}" if others else
                 f"no server left: waiting up to {self.wait:g} s for one to answer (--server-wait)")
        self.tell(f"server {self.urls[i]} stopped answering ({reason}); out of the rotation, {where}")

    def _back(self, i: int) -> None:
        with self._lock:
            if self.up[i] or self.gone:
                return
            self.up[i], self.all_down_since = True, None
            self._freed.notify_all()
        self.tell(f"server {self.urls[i]} answers again; back in the rotation")

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.probe_every):
            with self._lock:
                down = [i for i, u in enumerate(self.up) if not u]
                if not down or self.gone:
                    return
            for i in down:
                try:
                    self.probe(self.urls[i])
                except ServerUnreachable:
                    continue
                except Exception:               # an answer, even an error, is an answer
                    pass
                self._back(i)

    def gone_message(self) -> str:
        return (f"no server answered for {self.wait:g} s ({', '.join(self.urls)}): stopped, the rows done are "
                "kept; rerun the same command when a server answers again")

    def close(self) -> None:
        self._closed.set()
