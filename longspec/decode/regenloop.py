"""Regeneration's loop (`python -m longspec.regenerate`): each row asked of an engine by the prompt
rules (longspec.data.regen.Prompter, used through its methods: next_request, problem, take), the
finished rows handed on in source order.

  embedded_rows   the local target: rows a batch at a time, a chat's turns in rounds
  served_rows     servers: each row run to its end on the engine's threads (its turns one after
                  another), at most `window` rows in flight (longspec.decode.engines.ordered). A
                  failed request fails its row with the engine's masked message; an answer the
                  prompter finds unfit (empty, too long, text the tokenizer refuses) fails it too.
                  A stop (`stopped()`, a key refused, no server left) cuts the requests in
                  flight; rows not finished stay pending, for a rerun.
"""

from __future__ import annotations

from typing import Callable, Iterator

from longspec.decode.engines import EngineError, KeyRefused, Stopped, ordered
from longspec.decode.servers import ServersGone


def embedded_rows(engine, prompter, rows, stopped: Callable[[], bool]) -> Iterator:
    """Rows a batch at a time; a chat's turns in rounds (every row's next turn in one batch)."""
    while not stopped():
        chunk = [r for _, r in zip(range(engine.batch), rows)]
        if not chunk:
            return
        while not stopped():
            asks = [(r, q) for r in chunk if r.status == "pending" for q in [prompter.next_request(r)] if q]
            if not asks:
                break
            for (r, q), a in zip(asks, engine.answer([q for _, q in asks])):
                prompter.take(r, q, a)
        if any(r.status == "pending" for r in chunk):
            return                                     # stopped halfway through: a rerun makes this batch
        yield from chunk


def served_rows(engine, prompter, rows, window: int | None, stopped: Callable[[], bool], refused: list[str],
                tick: Callable[[], None]) -> Iterator:
    """Rows made by the servers, in source order; `refused` gets why a server refused the key."""

    def halted() -> bool:
        return bool(stopped() or refused) or engine.gone

    def step(row) -> None:
        while row.status == "pending":
            if halted():
                return                                 # the run stops: a row not finished is left for a rerun
            q = prompter.next_request(row)
            if q is None:
                return
            msgs = row.messages[:row.todo[0]] if row.kind == "chat" else None
            try:
                ans = engine.ask(q, msgs)
            except (ServersGone, Stopped):
                return                                 # left pending: not written, a rerun makes it
            except KeyRefused as e:
                refused.append(str(e))                 # every request would be refused: stop, not a row failure
                return
            except EngineError as e:
                row.status, row.reason = "failed", engine.shown(str(e))
                return
            why = prompter.problem(row, q, ans)
            if why is not None:
                row.status, row.reason = "failed", why
                return
            prompter.take(row, q, ans)

    def stop() -> bool:
        if halted():
            engine.close()                             # requests in flight are cut, none is started
            return True
        return False

    yield from ordered(engine, rows, step, window or len(engine.urls) * engine.concurrency * 4, stop, tick=tick)
