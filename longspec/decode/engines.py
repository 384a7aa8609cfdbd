"""Where regeneration's answers come from (`python -m longspec.regenerate`): greedy decoding on the
local target, or OpenAI-compatible servers (vLLM, `transformers serve`, SGLang).

Both take requests with the same shape (prompt ids and text, new-token limit, stop tokens and
stop text; longspec.data.regen.Request) and give answers (text, new tokens with the stop token,
finish reason "stop" | "length"), so the rows do not depend on which one made them:

  EmbeddedEngine   transformers `generate` on left-padded batches, greedy (temperature 0), the
                   stop ids as its eos_token_id; the text decoded without special tokens.
  ServerEngine     POST /v1/completions with the prompt text as the chat template rendered it
                   here (what the trainer reads), temperature 0, the end-of-turn text as `stop`;
                   or /v1/chat/completions (api="chat") with the turns and `chat_template_kwargs`
                   as a top-level field (vLLM and transformers serve read it there); streamed
                   (server-sent events, longspec.decode.openai_http), every read bounded. Several
                   servers: each gets `concurrency` requests at a time; a 408, 429 or 5xx, an
                   answer that breaks off and one with no byte for `idle` seconds are tried again
                   (Retry-After honoured, capped), other HTTP errors fail the row with a short,
                   masked excerpt of the server's words; a server that cannot be reached leaves
                   the rotation until it answers again (longspec.decode.servers), and the request
                   goes elsewhere.

Requests may carry different limits; an engine answers a list of them in order.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from longspec.decode import openai_http as H
from longspec.decode.servers import Rotation, ServerUnreachable

RETRY_CODES = (408, 429, 500, 502, 503, 504)
RETRY_AFTER_CAP = 120.0              # seconds: the longest Retry-After waited for (a longer one: this long)
MODELS_BYTES = 1 << 20               # /v1/models' body
ANSWER_BYTES, ANSWER_BYTES_PER_TOKEN = 1 << 20, 2048   # an answer's stream: 1 MiB + 2 KiB per new token allowed
TICK_S = 0.5


@dataclass
class Answer:
    text: str
    tokens: int          # new tokens, the stop token included (as a server's usage counts them); -1: not said
    finish: str          # "stop" | "length"


class EngineError(RuntimeError):
    """A request that failed for good (the row is counted failed) or a server that cannot be used."""


class KeyRefused(EngineError):
    """A server answered 401 or 403: the key is missing or wrong. The run stops at once."""


class Stopped(Exception):
    """The run is stopping: a request in flight was cut, or none is started (not a row's failure)."""


class EmbeddedEngine:
    """Greedy decoding on the target in this process, `batch` prompts at a time."""

    kind = "embedded"

    def __init__(self, target, tokenizer, batch: int = 8, device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.tok, self.batch = tokenizer, batch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).to(self.device).eval()
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def describe(self) -> dict:
        return {"kind": self.kind, "device": self.device, "batch": self.batch}

    def answer(self, requests: list) -> list:
        """Answers in the requests' order. A batch holds requests with the same stop tokens only
        (`generate` stops a row at any of its eos ids: a document must not stop at an end of turn)."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(tuple(r.stop_ids), []).append(i)
        got: dict[int, Any] = {}
        for idx in groups.values():
            idx.sort(key=lambda i: -len(requests[i].ids))                  # alike lengths together
            for s in range(0, len(idx), self.batch):
                chunk = idx[s:s + self.batch]
                for i, a in zip(chunk, self._batch([requests[i] for i in chunk])):
                    got[i] = a
        return [got[i] for i in range(len(requests))]

    def _batch(self, reqs: list) -> list:
        import torch

        T = max(len(r.ids) for r in reqs)
        ids = torch.full((len(reqs), T), self.pad, dtype=torch.long)       # (B, T), left-padded
        mask = torch.zeros((len(reqs), T), dtype=torch.long)                # (B, T)
        for b, r in enumerate(reqs):
            ids[b, T - len(r.ids):] = torch.tensor(r.ids)
            mask[b, T - len(r.ids):] = 1
        stops = list(reqs[0].stop_ids)
        with torch.no_grad():
            gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      do_sample=False, max_new_tokens=max(r.max_new for r in reqs),
                                      eos_token_id=stops or None, pad_token_id=self.pad)
        out = []
        for b, r in enumerate(reqs):
            new = gen[b, T:].tolist()[:r.max_new]
            end = next((k for k, t in enumerate(new) if t in r.stop_ids), None)
            if end is None:
                kept, n, finish = new, len(new), "length"
            else:
                kept, n, finish = new[:end], end + 1, "stop"
            out.append(Answer(self.tok.decode(kept, skip_special_tokens=True), n, finish))
        return out


class ServerEngine:
    """OpenAI-compatible servers: `concurrency` requests at a time on each that answers
    (longspec.decode.servers.Rotation: a server that gives no answer leaves the rotation until it
    answers again; `gone` turns true when none has answered for `wait` seconds).

    Every request streams (`stream: true`) through longspec.decode.openai_http: no byte for `idle`
    seconds abandons it (a try); 408, 429, 5xx, a break mid-answer and an idle request are tried
    `retries` more times (Retry-After honoured up to `retry_cap` seconds, else backoff), then the
    row fails. The served model is checked against `target` at the start (`served_model` names
    another one on purpose)."""

    kind = "server"

    def __init__(self, urls: list[str], concurrency: int = 4, api: str = "completions", idle: float = 120.0,
                 retries: int = 5, backoff: float = 1.0, template_kwargs: dict | None = None, wait: float = 60.0,
                 key_envs: list[str] | None = None, target: str | None = None, max_seq_length: int | None = None,
                 served_model: str | None = None, retry_cap: float = RETRY_AFTER_CAP):
        """key_envs: the environment variables the servers' keys are read from (longspec.project.
        serverkeys: OPENAI_API_KEY by default, one for all or one per server); a key is sent as
        `Authorization: Bearer KEY` to its server's origin alone, and shown nowhere."""
        from longspec.project import serverkeys

        if api not in ("completions", "chat"):
            raise EngineError(f"server api {api!r}: choose completions or chat")
        try:
            plan = serverkeys.plan(list(urls), list(key_envs or []))
        except serverkeys.KeyProblem as e:
            raise EngineError(str(e)) from None
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        self._keys = {u: serverkeys.key_of(k) for u, k in zip(self.urls, plan)}
        self.key_envs = {u: k.env for u, k in zip(self.urls, plan)}
        self.concurrency, self.api, self.idle, self.wait = concurrency, api, idle, wait
        self.retries, self.backoff, self.retry_cap = retries, backoff, retry_cap
        self.template_kwargs = dict(template_kwargs or {})
        self.stopping = threading.Event()
        self.clients = {u: H.Client(u, self._keys[u], self.stopping) for u in self.urls}
        self.inflight, self._count = 0, threading.Lock()
        deadline = time.monotonic() + wait
        self.served = {u: self._served(u, deadline, target, max_seq_length, served_model) for u in self.urls}
        self.models = {u: s.get("id") for u, s in self.served.items()}
        self.pool = ThreadPoolExecutor(max_workers=len(self.urls) * concurrency, thread_name_prefix="regen")
        self.rotation = Rotation(self.urls, concurrency, wait, self._probe)

    @property
    def gone(self) -> bool:
        return self.rotation.gone

    def describe(self) -> dict:
        return {"kind": self.kind, "servers": self.urls, "api": self.api, "concurrency": self.concurrency,
                "models": self.models, "served": self.served,
                "key_envs": {u: e for u, e in self.key_envs.items() if self._keys[u]}}

    def shown(self, text: str) -> str:
        """`text` with every key masked (a message that may hold what a server wrote)."""
        return H.mask(text, self._keys.values())

    def close(self) -> None:
        """Stop: requests in flight are cut (their sockets closed), none is started."""
        self.stopping.set()
        for c in self.clients.values():
            c.abort_all()
        self.rotation.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the served model

    def _served(self, url: str, deadline: float, target, max_seq_length, named) -> dict:
        """What `url` serves ({id, max_model_len, named}), from /v1/models, asked until `deadline`
        (--server-wait); a server that serves another model than `target` is refused unless `named`."""
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"server {url} does not answer /v1/models within {self.wait:g} s (--server-wait): {last}")
            try:
                reply = self._request(url, "/v1/models", None, idle=max(min(left, self.idle), 0.5),
                                      max_bytes=MODELS_BYTES)
            except (H.Unreachable, H.Idle, H.BrokeOff) as e:
                last = str(e)
                time.sleep(min(self.backoff, max(deadline - time.monotonic(), 0)))
                continue
            except H.TooLarge:
                raise EngineError(f"server {url}/v1/models answers with a body over {MODELS_BYTES} bytes: "
                                  "not an OpenAI-compatible server?") from None
            if reply.status in (401, 403):
                raise KeyRefused(self._refusal(url, reply.status))
            if reply.status >= 300:
                raise EngineError(f"server {url}: /v1/models answered HTTP {reply.status}"
                                  + (f": {self._excerpt(reply.body)}" if reply.body.strip() else ""))
            try:
                doc = json.loads(reply.body)
            except ValueError:
                raise EngineError(f"server {url}: /v1/models answered what is not JSON "
                                  f"({self._excerpt(reply.body) or 'an empty body'}): not an OpenAI-compatible server?") from None
            data = doc.get("data") if isinstance(doc, dict) else None
            entries = [d for d in data if isinstance(d, dict) and isinstance(d.get("id"), str)] if isinstance(data, list) else []
            return served_entry(url, entries, target, max_seq_length, named)

    def _excerpt(self, raw: bytes) -> str:
        return H.excerpt(raw, self._keys.values())

    def _refusal(self, url: str, code: int) -> str:
        env = self.key_envs[url]
        if not self._keys.get(url):
            return (f"server {url} wants a key (HTTP {code}) and none was sent: {env} is not set; export it, or "
                    "name the variable that holds the key with --api-key-env NAME")
        return f"server {url} refused the key read from {env} (HTTP {code}; the key is not shown): check {env}"

    def _probe(self, url: str) -> None:
        try:
            self._request(url, "/v1/models", None, idle=5.0, max_bytes=MODELS_BYTES)
        except (H.Unreachable, H.Idle, H.BrokeOff, H.Stopped) as e:
            raise ServerUnreachable(url, str(e) or "stopped") from None

    # ------------------------------------------------------------------ requests

    def ask(self, request, messages: list[dict] | None = None):
        """One request's Answer, in this thread (a row's turns are asked one after another).
        ServersGone when no server has answered for the rotation's wait; Stopped once `close` ran."""
        while True:
            if self.stopping.is_set():
                raise Stopped()
            i = self.rotation.acquire()
            try:
                return self._one(self.urls[i], request, messages)
            except ServerUnreachable as e:
                self.rotation.down(i, e.reason)          # asked again, on another server or later
            finally:
                self.rotation.release(i)

    def answer(self, requests: list, messages: list | None = None) -> list:
        futs = [self.pool.submit(self.ask, r, (messages or [None] * len(requests))[i])
                for i, r in enumerate(requests)]
        return [f.result() for f in futs]

    def _one(self, url: str, req, messages):
        body: dict[str, Any] = {"max_tokens": req.max_new, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.models[url]:
            body["model"] = self.models[url]
        if req.stop_texts:
            body["stop"] = list(req.stop_texts)
        chat = self.api == "chat" and messages is not None
        if chat:
            body["messages"] = messages
            body["chat_template_kwargs"] = self.template_kwargs
        else:
            body["prompt"] = req.text
        path = "/v1/chat/completions" if chat else "/v1/completions"
        reply = self._call(url, path, body, ANSWER_BYTES + ANSWER_BYTES_PER_TOKEN * req.max_new)
        try:
            return read_answer(reply, chat)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise EngineError(f"{url}{path}: an answer that cannot be read ({self.shown(str(e))[:H.EXCERPT]})") from None

    def _request(self, url: str, path: str, body: dict | None, idle: float, max_bytes: int):
        with self._count:
            self.inflight += 1
        try:
            return self.clients[url].request("GET" if body is None else "POST", path, body, idle, max_bytes,
                                             stream=body is not None)
        except H.Redirected as e:
            raise EngineError(f"server {url}{path} redirects to {shown_url(str(e))}: not followed (the key goes to "
                              f"{url} alone); give --server the URL it redirects to") from None
        except H.Stopped:
            raise Stopped() from None
        finally:
            with self._count:
                self.inflight -= 1

    def _call(self, url: str, path: str, body: dict, max_bytes: int):
        """POST one request, tried again on 408, 429, 5xx, an idle wait or a break mid-answer;
        other HTTP errors raise EngineError, no connection ServerUnreachable."""
        last = ""
        for k in range(self.retries + 1):
            delay = min(self.backoff * 2 ** k, self.retry_cap)     # a long --retries waits no more than the cap
            try:
                reply = self._request(url, path, body, self.idle, max_bytes)
            except H.Unreachable as e:
                raise ServerUnreachable(url, str(e)) from None
            except (H.Idle, H.BrokeOff) as e:
                last = str(e)
            except H.TooLarge as e:
                raise EngineError(f"{url}{path}: {e}, past the bound for {body['max_tokens']} new tokens") from None
            except ValueError as e:
                raise EngineError(f"{url}{path}: {self.shown(str(e))}") from None
            else:
                if reply.status in (401, 403):
                    raise KeyRefused(self._refusal(url, reply.status))
                if reply.status < 300:
                    return reply
                said = self._excerpt(reply.body)
                last = f"HTTP {reply.status}" + (f": {said}" if said else "")
                if reply.status not in RETRY_CODES:
                    raise EngineError(f"{url}{path}: {last}")
                wait = H.retry_after(reply.headers.get("retry-after"), self.retry_cap)
                delay = delay if wait is None else wait
            if k < self.retries and self.stopping.wait(delay):
                raise Stopped()
        raise EngineError(f"{url}{path}: {last} (after {self.retries + 1} attempts)")


def read_answer(reply, chat: bool) -> Answer:
    """An Answer from a streamed reply's events (or a whole JSON body, from a server that does not
    stream). No text at all (no `text`, a null `content`) is an error; "" is an empty answer."""
    events = reply.events if reply.events or not reply.body else [json.loads(reply.body)]
    parts: list[str] = []
    finish, usage, saw = None, None, False
    for ev in events:
        if ev.get("error"):
            raise ValueError(f"the server reported an error mid-answer: {ev['error']}")
        if isinstance(ev.get("usage"), dict):
            usage = ev["usage"]
        for c in ev.get("choices") or []:
            piece = (c.get("delta") or c.get("message") or {}).get("content") if chat else c.get("text")
            if piece is not None:
                if not isinstance(piece, str):
                    raise TypeError(f"answer text of type {type(piece).__name__}")
                parts.append(piece)
                saw = True
            finish = c.get("finish_reason") or finish
    if not saw:
        raise ValueError("no answer text (no `text`, or a null `content`)")
    if reply.events and finish is None:
        raise ValueError("the stream ended without a finish reason (an answer cut off)")
    tokens = usage.get("completion_tokens") if usage else None
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else -1
    return Answer("".join(parts), tokens, "length" if finish == "length" else "stop")


def served_entry(url: str, entries: list[dict], target, max_seq_length, named) -> dict:
    """The /v1/models entry requests go to, checked: its id names the stage's target (the same path,
    or the same last path part: vLLM serves `/models/QwQ-32B` as that path, a hub id as `org/QwQ-32B`)
    and its max_model_len, where the server gives one, holds max_seq_length. `named`
    (--served-model) is taken as it is, when the server serves it."""
    ids = [e["id"] for e in entries]
    if named:
        hit = next((e for e in entries if e["id"] == named), None)
        if hit is None:
            raise EngineError(f"server {url} does not serve --served-model {named!r} (it serves "
                              f"{', '.join(map(repr, ids[:5])) or 'no model it names'})")
        return {"id": named, "max_model_len": hit.get("max_model_len"), "named": True}
    if not entries:
        return {"id": None, "max_model_len": None, "named": False}
    if target is None:
        return {"id": ids[0], "max_model_len": entries[0].get("max_model_len"), "named": False}
    want = str(target).rstrip("/")
    hit = next((e for e in entries if e["id"].rstrip("/") == want), None) or next(
        (e for e in entries if e["id"].rstrip("/").rsplit("/", 1)[-1].lower() == want.rsplit("/", 1)[-1].lower()), None)
    if hit is None:
        raise EngineError(f"server {url} serves {', '.join(map(repr, ids[:5]))}, not the stage's target {want}: its "
                          f"answers would not be the target's. Start it on the target, or, if it is the same model "
                          f"under another name, say so with --served-model {ids[0]!r}")
    n = hit.get("max_model_len")
    if isinstance(n, int) and max_seq_length and n < max_seq_length:
        raise EngineError(f"server {url} serves {hit['id']!r} with max_model_len {n}, below the stage's "
                          f"max_seq_length {max_seq_length}: longer prompts would be refused. Start it with "
                          f"--max-model-len {max_seq_length}, or take it as it is with --served-model {hit['id']!r}")
    return {"id": hit["id"], "max_model_len": n if isinstance(n, int) else None, "named": False}


def shown_url(url: str) -> str:
    """A URL a server named, fit to show: credentials and query dropped, one line, short."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        p = urlsplit(url.strip())
        host = (p.hostname or "") + (f":{p.port}" if p.port else "")
        return H.excerpt(urlunsplit((p.scheme, host, p.path, "", "")) if p.scheme else p.path, limit=120)
    except ValueError:
        return "(a URL that cannot be read)"


def ordered(engine, rows, step: Callable, window: int, stop: Callable[[], bool], tick: Callable[[], None] = lambda: None):
    """Yield rows in source order as each finishes; `step(row)` runs one row to its end on the
    server engine's threads (its turns asked one after another with `ask`). At most `window` rows
    are in flight: the reorder buffer. `tick` is called about every TICK_S while waiting. When
    `stop()` turns true, rows already finished in order are still yielded; the rest are abandoned
    (a rerun makes them)."""
    from collections import deque
    from concurrent.futures import wait

    inflight: deque = deque()
    it = iter(rows)
    while True:
        while len(inflight) < window and not stop():
            row = next(it, None)
            if row is None:
                break
            inflight.append((row, engine.pool.submit(step, row)))
        if not inflight:
            return
        while not inflight[0][1].done() and not stop():
            wait([inflight[0][1]], timeout=TICK_S)
            tick()
        if not inflight[0][1].done():
            return                                   # stopped: the rest is abandoned; rows already done were yielded
        row, fut = inflight.popleft()
        fut.result()
        if row.status == "pending":
            return                                   # abandoned (no server left, a stop): a rerun makes it
        yield row
