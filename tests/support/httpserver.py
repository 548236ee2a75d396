"""A real HTTP server on 127.0.0.1 for protocol tests: serves bodies (HEAD, GET, Range),
answers scripted failures first (statuses, a body cut short), and logs every request."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TRUNCATE = "truncate"  # a scripted failure: send half the body under the full Content-Length


@dataclass
class HttpServer:
    """Files by path, failures to answer before serving them, and the requests seen."""

    url: str
    bodies: dict[str, bytes] = field(default_factory=dict)
    failures: dict[str, list[int | str]] = field(default_factory=dict)
    failing_method: dict[str, str | None] = field(default_factory=dict)
    requests: list[tuple[str, str, int | str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self,
        path: str,
        body: bytes,
        failures: list[int | str] | None = None,
        method: str | None = None,
    ) -> str:
        """Serve ``body`` at ``path`` after answering ``failures``, one per request (of
        ``method`` only, when given)."""
        with self.lock:
            self.bodies[path] = body
            self.failures[path] = list(failures or [])
            self.failing_method[path] = method
        return self.url + path

    def seen(self, path: str, method: str | None = None) -> list[int | str]:
        """What each request for ``path`` (of ``method``) was answered."""
        with self.lock:
            return [a for m, p, a in self.requests if p == path and method in (None, m)]

    def _next_failure(self, method: str, path: str) -> int | str | None:
        with self.lock:
            queue = self.failures.get(path, [])
            applies = self.failing_method.get(path) in (None, method)
            failure = queue.pop(0) if queue and applies else None
            answer = failure if failure is not None else (200 if path in self.bodies else 404)
            self.requests.append((method, path, answer))
            return failure


def _handler(server: HttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            return None

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def _answer(self, *, send_body: bool) -> None:
            failure = server._next_failure(self.command, self.path)
            body = server.bodies.get(self.path)
            if isinstance(failure, int) or body is None:
                self._status(failure if isinstance(failure, int) else 404)
                return
            start, end = 0, len(body)
            ranged = self.headers.get("Range", "").removeprefix("bytes=")
            if ranged:
                first, _, last = ranged.partition("-")
                start, end = int(first), min(len(body), int(last) + 1 if last else len(body))
            self.send_response(206 if ranged else 200)
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
            self.end_headers()
            if not send_body:
                return
            if failure == TRUNCATE:
                self.wfile.write(body[start : start + (end - start) // 2])
                self.close_connection = True
                return
            self.wfile.write(body[start:end])

        def _status(self, status: int) -> None:
            payload = f"status {status}".encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    return Handler


@contextmanager
def http_server(tls: ssl.SSLContext | None = None) -> Iterator[HttpServer]:
    """Start a threaded HTTP server on an ephemeral loopback port for the duration
    (HTTPS when given a server-side ``tls`` context)."""
    state = HttpServer(url="")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    scheme = "https" if tls is not None else "http"
    state.url = f"{scheme}://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
