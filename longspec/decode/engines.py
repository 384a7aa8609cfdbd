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
                   as a top-level field (vLLM and transformers serve read it there). Several
                   servers: each gets `concurrency` requests at a time; a 408, 429 or 5xx is
                   retried with exponential backoff, other HTTP errors fail the row; a server that
                   gives no answer (refused, reset, timed out) leaves the rotation until it answers
                   again (longspec.decode.servers), and the request goes elsewhere.

Requests may carry different limits; an engine answers a list of them in order.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from longspec.decode.servers import Rotation, ServerUnreachable

RETRY_CODES = (408, 429, 500, 502, 503, 504)


@dataclass
class Answer:
    text: str
    tokens: int          # new tokens, the stop token included (as a server's usage counts them)
    finish: str          # "stop" | "length"


class EngineError(RuntimeError):
    """A request that failed for good (the row is counted failed) or a server that cannot be used."""


class KeyRefused(EngineError):
    """A server answered 401 or 403: the key is missing or wrong. The run stops at once."""


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
    answers again; `gone` turns true when none has answered for `wait` seconds)."""

    kind = "server"

    def __init__(self, urls: list[str], concurrency: int = 4, api: str = "completions", timeout: float = 600.0,
                 retries: int = 5, backoff: float = 1.0, template_kwargs: dict | None = None, wait: float = 60.0,
                 key_envs: list[str] | None = None):
        """key_envs: the environment variables the servers' keys are read from (longspec.project.
        serverkeys: OPENAI_API_KEY by default, one for all or one per server); a key is sent as
        `Authorization: Bearer KEY` and shown nowhere."""
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
        self.concurrency, self.api, self.timeout = concurrency, api, timeout
        self.retries, self.backoff = retries, backoff
        self.template_kwargs = dict(template_kwargs or {})
        self.models = {u: self._model_id(u) for u in self.urls}
        self.pool = ThreadPoolExecutor(max_workers=len(self.urls) * concurrency, thread_name_prefix="regen")
        self.rotation = Rotation(self.urls, concurrency, wait, self._probe)

    @property
    def gone(self) -> bool:
        return self.rotation.gone

    def describe(self) -> dict:
        return {"kind": self.kind, "servers": self.urls, "api": self.api, "concurrency": self.concurrency,
                "models": self.models, "key_envs": {u: e for u, e in self.key_envs.items() if self._keys[u]}}

    def close(self) -> None:
        self.rotation.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _model_id(self, url: str) -> str | None:
        """The served model's id (vLLM needs it in every request; a pinned transformers serve
        wants the exact string or none). A server that does not answer is refused here."""
        for k in range(3):
            try:
                doc = self._call(url, "/v1/models", None)
                break
            except ServerUnreachable as e:
                if k == 2:
                    raise EngineError(f"server {url} does not answer /v1/models: {e.reason}") from None
                time.sleep(self.backoff * 2 ** k)
        data = doc.get("data") if isinstance(doc, dict) else None
        return data[0].get("id") if data and isinstance(data[0], dict) else None

    def _refusal(self, url: str, code: int) -> str:
        env = self.key_envs[url]
        if not self._keys.get(url):
            return (f"server {url} wants a key (HTTP {code}) and none was sent: {env} is not set; export it, or "
                    "name the variable that holds the key with --api-key-env NAME")
        return f"server {url} refused the key read from {env} (HTTP {code}; the key is not shown): check {env}"

    def _probe(self, url: str) -> None:
        self._call(url, "/v1/models", None, timeout=5.0)

    def ask(self, request, messages: list[dict] | None = None):
        """One request's Answer, in this thread (a row's turns are asked one after another).
        ServersGone when no server has answered for the rotation's wait."""
        while True:
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
        body: dict[str, Any] = {"max_tokens": req.max_new, "temperature": 0}
        if self.models[url]:
            body["model"] = self.models[url]
        if req.stop_texts:
            body["stop"] = list(req.stop_texts)
        try:
            if self.api == "chat" and messages is not None:
                body["messages"] = messages
                body["chat_template_kwargs"] = self.template_kwargs
                doc = self._call(url, "/v1/chat/completions", body)
                choice = doc["choices"][0]
                text = (choice.get("message") or {}).get("content") or ""
            else:
                body["prompt"] = req.text
                doc = self._call(url, "/v1/completions", body)
                choice = doc["choices"][0]
                text = choice.get("text") or ""
            finish = "length" if choice.get("finish_reason") == "length" else "stop"
            tokens = int((doc.get("usage") or {}).get("completion_tokens") or 0)
            return Answer(text, tokens, finish)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"unexpected answer from {url}: {e!r}") from None

    def _call(self, url: str, path: str, body: dict | None, timeout: float | None = None) -> dict:
        """GET (body None) or POST JSON to one server; 408, 429 and 5xx retried with backoff (the
        server answers: it is up), other HTTP errors raise EngineError, no answer ServerUnreachable."""
        last = ""
        for k in range(self.retries + 1):
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"}
            if self._keys.get(url):
                headers["Authorization"] = f"Bearer {self._keys[url]}"
            req = urllib.request.Request(url + path, data=data, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                if e.code in (401, 403):
                    raise KeyRefused(self._refusal(url, e.code)) from None
                detail = e.read()[:300].decode("utf-8", "replace")   # a 500 body may be plain text
                last = f"HTTP {e.code}: {detail}"
                if e.code not in RETRY_CODES:
                    raise EngineError(f"{url}{path}: {last}") from None
            except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as e:
                raise ServerUnreachable(url, str(getattr(e, "reason", e)) or type(e).__name__) from None
            if k < self.retries:
                time.sleep(self.backoff * 2 ** k)
        raise EngineError(f"{url}{path}: {last} (after {self.retries + 1} attempts)")


def ordered(engine, rows, step: Callable, window: int, stop: Callable[[], bool]):
    """Yield rows in source order as each finishes; `step(row)` runs one row to its end on the
    server engine's threads (its turns asked one after another with `ask`). At most `window` rows
    are in flight: the reorder buffer. When `stop()` turns true, rows already finished in order
    are still yielded; the rest are abandoned (a rerun makes them)."""
    from collections import deque

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
        if stop() and not inflight[0][1].done():
            return                                   # the rest is abandoned; rows already done were yielded
        row, fut = inflight.popleft()
        fut.result()
        if row.status == "pending":
            return                                   # abandoned (no server left): a rerun makes it
        yield row
