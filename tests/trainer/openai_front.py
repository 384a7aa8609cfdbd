"""A small front on 127.0.0.1 that passes OpenAI-compatible requests on to a real server (the
tests' `transformers serve`), the way a gateway stands in front of vLLM: it can want a key
(`Authorization: Bearer KEY`, 401 otherwise, as vLLM's --api-key does) and refuse chosen requests
with a 400 (a request the server rejects for itself). It records what it saw."""

from __future__ import annotations

import ssl
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


class Front:
    def __init__(self, upstream: str, key: str | None = None, refuse: Callable[[bytes], bool] | None = None,
                 tls: tuple[str, str] | None = None):
        """tls: (certificate, private key) files: the front speaks https."""
        self.upstream, self.key, self.refuse = upstream, key, refuse
        self.open: set[str] = set()                 # paths served without the key
        self.seen: list[dict] = []                  # {path, auth} per request
        self.refused = 0
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _pass(self, body: bytes | None) -> None:
                auth = self.headers.get("Authorization")
                front.seen.append({"path": self.path, "auth": auth})
                if front.key is not None and auth != f"Bearer {front.key}" and self.path not in front.open:
                    return self._send(401, b'{"error": "Unauthorized"}')
                if body is not None and front.refuse is not None and front.refuse(body):
                    front.refused += 1
                    return self._send(400, b'{"error": {"message": "this request is refused"}}')
                req = urllib.request.Request(front.upstream + self.path, data=body,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=600) as r:      # a stream passed on whole
                        self._send(r.status, r.read(), r.headers.get("Content-Type") or "application/json")
                except urllib.error.HTTPError as e:
                    self._send(e.code, e.read())

            def do_GET(self):
                self._pass(None)

            def do_POST(self):
                self._pass(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"http{'s' if tls else ''}://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
