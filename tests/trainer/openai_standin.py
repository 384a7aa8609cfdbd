"""An OpenAI-compatible stand-in on 127.0.0.1 (stdlib http.server in a thread) that answers each
prompt with a text made from the prompt itself, streamed as server-sent events, and misbehaves on
request the way broken or hostile servers do: `fault(prompt)` names what to do to a completion,
`models` what /v1/models answers. It records what it saw ({path, auth, prompt, at})."""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

FAULTS = ("key400", "key500", "redirect", "empty", "null", "huge", "long", "surrogate", "badutf8", "stall",
          "ratelimit", "lie", "hang")


def answer_of(prompt: str) -> str:
    """The stand-in's answer: a few digits chosen by the prompt (text any tokenizer takes)."""
    d = hashlib.sha256(prompt.encode()).digest()
    return " ".join(str(b % 10) for b in d[:6]) + " ."


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass                                  # a client that hung up on a stream it refused: expected


class StandIn:
    def __init__(self, model_id: str):
        self.model_id = model_id
        self.models: str | None = None        # None | "other" | "not-json" | "hang" | "redirect" | "short"
        self.fault: Callable[[str], str | None] = lambda prompt: None
        self.redirect_to = ""                 # a redirect's Location
        self.seen: list[dict] = []
        self.limited: dict[str, float] = {}   # prompt -> when it was first rate-limited
        self.limit_seconds = 3.0              # "ratelimit": 429 with Retry-After for this long
        self.release = threading.Event()      # hung requests end when it is set
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"     # a body ends when the connection closes (a stream too)

            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json", **headers: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in headers.items():
                    self.send_header(k.replace("_", "-"), v)
                self.end_headers()
                self.wfile.write(body)

            def _hang(self) -> None:
                standin.release.wait(120)

            def do_GET(self):
                auth = self.headers.get("Authorization")
                standin.seen.append({"path": self.path, "auth": auth, "prompt": None, "at": time.monotonic()})
                if self.path != "/v1/models":
                    return self._send(404, b'{"error": "not found"}')
                how = standin.models
                if how == "hang":
                    return self._hang()
                if how == "not-json":
                    return self._send(200, b"<html><body>It works!</body></html>" * 50, "text/html")
                if how == "redirect":
                    return self._send(302, b"", Location=standin.redirect_to)
                entry = {"id": "some-other-model" if how == "other" else standin.model_id, "object": "model"}
                if how == "short":
                    entry["max_model_len"] = 64
                self._send(200, json.dumps({"object": "list", "data": [entry]}).encode())

            def do_POST(self):
                auth = self.headers.get("Authorization") or ""
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                prompt = body.get("prompt") or json.dumps(body.get("messages"))
                standin.seen.append({"path": self.path, "auth": auth, "prompt": prompt, "at": time.monotonic()})
                fault = standin.fault(prompt)
                echo = f"Authorization: {auth} (your header: {auth}) {auth}"
                if fault == "key400":
                    return self._send(400, json.dumps({"error": "bad request", "echo": echo}).encode())
                if fault == "key500":
                    return self._send(500, f"Internal Server Error\n{echo}\n".encode(), "text/plain")
                if fault == "badutf8":
                    return self._send(500, b"\xff\xfe\xfa" * 350_000, "text/plain")
                if fault == "redirect":
                    return self._send(302, b"", Location=standin.redirect_to)
                if fault == "hang":
                    return self._hang()
                if fault == "ratelimit":
                    first = standin.limited.setdefault(prompt, time.monotonic())
                    left = standin.limit_seconds - (time.monotonic() - first)
                    if left > 0:
                        return self._send(429, b'{"error": "slow down"}', Retry_After=str(math.ceil(left)))
                text = answer_of(prompt)
                if fault == "empty":
                    text = ""
                elif fault == "long":
                    text = "1 " * 3000
                elif fault == "surrogate":
                    text = text[:4] + "\ud800"
                self._stream(body, text, fault)

            def _stream(self, body: dict, text: str, fault: str | None) -> None:
                chat = "messages" in body
                if not body.get("stream"):            # a client that does not stream: one JSON body
                    return self._whole(chat, text, fault)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def event(piece, finish=None, **extra) -> bytes:
                    choice = ({"delta": {"content": piece}} if chat else {"text": piece}) if piece is not ... else {}
                    return b"data: " + json.dumps({"choices": [{**choice, "finish_reason": finish}], **extra}).encode() + b"\n\n"

                if fault == "null":
                    self.wfile.write(event(None, "stop"))
                elif fault == "huge":
                    chunk = event("9 " * 500)
                    for _ in range(5_000_000 // len(chunk)):
                        self.wfile.write(chunk)
                elif fault == "stall":
                    self.wfile.write(event(text[:2]))
                    self.wfile.flush()
                    return self._hang()
                else:
                    for k in range(0, max(len(text), 1), 4):
                        self.wfile.write(event(text[k:k + 4]))
                    self.wfile.write(event(..., "stop"))
                if fault == "lie":
                    self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 1_388_889}}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

            def _whole(self, chat: bool, text: str, fault: str | None) -> None:
                text = None if fault == "null" else ("9 " * 2_500_000 if fault == "huge" else text)
                choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
                doc = {"choices": [{**choice, "finish_reason": "stop"}]}
                if fault == "lie":
                    doc["usage"] = {"completion_tokens": 1_388_889}
                if fault == "stall":
                    return self._hang()
                self._send(200, json.dumps(doc).encode())

        self.httpd = _Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def completions(self) -> list[dict]:
        return [q for q in self.seen if q["prompt"] is not None]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
