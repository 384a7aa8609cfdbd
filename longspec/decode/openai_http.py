"""One request to an OpenAI-compatible server, as regeneration makes it (longspec.decode.engines
ServerEngine): http.client, one connection per request, every wait and every read bounded.

  - connect: at most CONNECT_S seconds (no connection: ServerUnreachable, the server's fault)
  - each read: at most `idle` seconds with no byte (Idle: the request's fault, retried by the caller)
  - a body: a stream (`stream: true`, server-sent events) is read event by event, at most
    `max_bytes` in all (TooLarge); a JSON or error body at most ERROR_BYTES / max_bytes
  - a redirect is never followed (Redirected names where it points: a key must not go there)
  - `stop`: a threading.Event; `abort_all` closes every socket in flight, so a reader wakes at once

Nothing a server wrote reaches a message whole: `excerpt` keeps the first EXCERPT characters on
one line, with the key and anything shaped `Bearer ...` masked (`mask`). Retry-After (seconds or an
HTTP date) is read by `retry_after`. Pure: the standard library only.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CONNECT_S = 10.0
ERROR_BYTES = 4096           # what is read of an error body (only an excerpt of it is shown)
EXCERPT = 160
LINE_BYTES = 1 << 20         # one server-sent event's line
_BEARER = re.compile(r"(?i)(bearer|authorization|api[-_]?key)([\"':=\s]+)[^\s\"',;}]+")


class Unreachable(Exception):
    """No connection, or the connection broke before the server answered."""


class Idle(Exception):
    """No byte for `idle` seconds."""


class BrokeOff(Exception):
    """The connection broke after the server began to answer."""


class TooLarge(Exception):
    """The body passed its bound."""


class Redirected(Exception):
    """A 3xx: not followed."""


class Stopped(Exception):
    """The run is stopping (the stop event is set)."""


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes = b""                                   # a JSON or error body (bounded)
    events: list[dict] = field(default_factory=list)    # a stream's events, parsed


def mask(text: str, secrets) -> str:
    """`text` with each secret and anything shaped `Bearer X` / `api_key: X` replaced by ***."""
    for s in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(s, "***")
    return _BEARER.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)


def excerpt(raw: bytes | str, secrets=(), limit: int = EXCERPT) -> str:
    """A short, single-line, masked excerpt of what a server wrote."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = mask(text[:limit * 8 + 4096], secrets)[:limit * 8]   # masked before the cut: no key's head left
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def retry_after(value: str | None, cap: float) -> float | None:
    """Retry-After in seconds (a number or an HTTP date), at most `cap`; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), cap)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return min(max(when.timestamp() - time.time(), 0.0), cap) if when is not None else None


class Client:
    """Requests to one server's origin; `key` goes as `Authorization: Bearer KEY`, to it alone."""

    def __init__(self, base: str, key: str | None, stop: threading.Event, context: ssl.SSLContext | None = None):
        parts = urlsplit(base)
        self.base, self.key, self.stop = base, key, stop
        self.https, self.host, self.port = parts.scheme == "https", parts.hostname or "", parts.port
        self.prefix = parts.path.rstrip("/")
        self.context = context
        self._live: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: dict | None, idle: float, max_bytes: int,
                stream: bool = False) -> Reply:
        """One request. A 2xx stream is read to its end ([DONE] or the connection closed); other
        bodies are read up to their bound. Raises Unreachable, Idle, BrokeOff, TooLarge, Redirected,
        Stopped, and ValueError for an event that is not JSON."""
        if self.stop.is_set():
            raise Stopped()
        conn = self._connect(idle)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if stream else "application/json"}
            if self.key:
                headers["Authorization"] = f"Bearer {self.key}"
            try:
                conn.request(method, self.prefix + path, body=data, headers=headers)
                resp = conn.getresponse()
            except (TimeoutError, socket.timeout):
                raise self._why(Idle(f"no answer for {idle:g} s")) from None
            except (OSError, http.client.HTTPException) as e:
                raise self._why(Unreachable(_reason(e))) from None
            except ValueError:                      # http.client refuses a header (its text holds the key)
                raise self._why(Unreachable("a request header could not be sent")) from None
            heads = {k.lower(): v for k, v in resp.getheaders()}
            if 300 <= resp.status < 400:
                raise Redirected(heads.get("location") or "(no Location)")
            try:
                if resp.status < 300 and "text/event-stream" in heads.get("content-type", ""):
                    return Reply(resp.status, heads, events=self._events(resp, max_bytes))
                bound = max_bytes if resp.status < 300 else ERROR_BYTES
                raw = resp.read(bound + 1)
                if len(raw) > bound and resp.status < 300:
                    raise TooLarge(f"a body over {bound:,} bytes")
                return Reply(resp.status, heads, body=raw[:bound])
            except (TimeoutError, socket.timeout):
                raise self._why(Idle(f"no byte for {idle:g} s")) from None
            except (OSError, http.client.HTTPException) as e:
                raise self._why(BrokeOff(f"the answer broke off ({_reason(e)})")) from None
        finally:
            self._drop(conn)

    def _events(self, resp, max_bytes: int) -> list[dict]:
        """A stream's `data:` events as parsed JSON, until [DONE] or the end of the body; a body
        that ends before any finish reason is an answer cut off (BrokeOff: a server killed mid-answer)."""
        events, seen, finished = [], 0, False
        while True:
            line = resp.readline(LINE_BYTES + 1)
            if not line:
                if not finished:
                    raise BrokeOff("the answer broke off (the stream ended before its finish reason)")
                return events
            seen += len(line)
            if seen > max_bytes or len(line) > LINE_BYTES:
                raise TooLarge(f"a stream over {min(seen, max_bytes):,} bytes")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue                                 # comments, event names, keep-alives
            data = line[5:].strip()
            if data == b"[DONE]":
                return events
            try:
                doc = json.loads(data)
            except ValueError:
                raise ValueError(f"an event that is not JSON: {excerpt(data, [self.key])}") from None
            events.append(doc if isinstance(doc, dict) else {"_": doc})
            choices = events[-1].get("choices")
            if isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
                finished = True

    def _connect(self, idle: float) -> http.client.HTTPConnection:
        timeout = min(CONNECT_S, idle)
        if self.https:
            if self.context is None:
                self.context = ssl.create_default_context()     # once: it reads the CA files
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout, context=self.context)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self._why(Unreachable(_reason(e))) from None
        conn.sock.settimeout(idle)                       # from here on: the bound between two bytes
        with self._lock:
            self._live.add(conn)
        if self.stop.is_set():
            self._drop(conn)
            raise Stopped()
        return conn

    def _drop(self, conn) -> None:
        with self._lock:
            self._live.discard(conn)
        conn.close()

    def _why(self, e: Exception) -> Exception:
        """What ended a request: the run's stop (its sockets were closed under it) or `e`."""
        return Stopped() if self.stop.is_set() else e

    def abort_all(self) -> None:
        """Close every connection in flight (a reader blocked on it wakes with an error)."""
        with self._lock:
            live = list(self._live)
        for conn in live:
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
    return str(reason) or type(e).__name__
