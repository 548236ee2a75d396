"""One client connection of :class:`~shardcache.testing.FaultProxy`: HTTP/1.1 messages read
and relayed to the upstream server (keep-alive, chunked bodies), a matching fault applied,
the bytes to the client shaped."""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from typing import Protocol
from urllib.parse import unquote

from shardcache._base.token_bucket import TokenBucket
from shardcache.testing.fault_rules import FaultRule, s3_error_response

logger = logging.getLogger("shardcache.testing.faultproxy")

_RECV = 64 * 1024
_MAX_HEAD = 64 * 1024
_POLL = 0.05  # seconds between checks of the stop flag while hanging / accepting
_SHAPE_SLICE = 16 * 1024  # bytes sent per token-bucket reservation when shaping


class ProxySide(Protocol):
    """What a connection needs of its proxy (:class:`~shardcache.testing.FaultProxy`):
    where upstream is, the shaping, the fault rules and request-rate limit, its counters and
    the sockets it must close when it stops."""

    upstream: tuple[str, int]
    connect_timeout: float
    latency: float
    conn_rate: float | None
    total_bucket: TokenBucket | None
    _stop: threading.Event

    @property
    def shaping(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...

    def _take(
        self, method: str, target: str, byte_range: str | None = None
    ) -> FaultRule | None: ...

    def _rate_admits(self) -> bool: ...

    def _count_forwarded(self) -> None: ...

    def _track(self, sock: socket.socket) -> None: ...

    def _forget(self, sock: socket.socket) -> None: ...


class _ClosedError(Exception):
    """The peer closed the connection in the middle of a message."""


class _Reader:
    """Buffered reads from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(_RECV)
        if not data:
            return False
        self.buf += data
        return True

    def read_until(self, sep: bytes, limit: int = _MAX_HEAD) -> bytes | None:
        """Bytes up to and including ``sep``; ``None`` on EOF before any byte."""
        while True:
            idx = self.buf.find(sep)
            if idx >= 0:
                out = bytes(self.buf[: idx + len(sep)])
                del self.buf[: idx + len(sep)]
                return out
            if len(self.buf) > limit:
                raise _ClosedError(f"header block longer than {limit} bytes")
            if not self._fill():
                if self.buf:
                    raise _ClosedError("connection closed mid-header")
                return None

    def read_some(self, n: int) -> bytes:
        """Up to ``n`` bytes (at least one); raises on EOF."""
        if not self.buf and not self._fill():
            raise _ClosedError("connection closed mid-body")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def read_all(self) -> bytes:
        """Whatever is buffered or one recv; ``b""`` on EOF."""
        if self.buf:
            out = bytes(self.buf)
            self.buf.clear()
            return out
        return self.sock.recv(_RECV)


class _Head:
    """Start line plus headers of one HTTP message."""

    def __init__(self, raw: bytes) -> None:
        lines = raw.decode("latin-1").split("\r\n")
        self.start = lines[0]
        self.headers: list[tuple[str, str]] = []
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                self.headers.append((name.strip(), value.strip()))

    def get(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def has_token(self, name: str, token: str) -> bool:
        value = self.get(name)
        return value is not None and token in [t.strip().lower() for t in value.split(",")]

    def remove(self, name: str) -> None:
        self.headers = [(k, v) for k, v in self.headers if k.lower() != name.lower()]

    def to_bytes(self) -> bytes:
        lines = [self.start, *(f"{k}: {v}" for k, v in self.headers), "", ""]
        return "\r\n".join(lines).encode("latin-1")

    def body_framing(self) -> tuple[str, int]:
        """``("chunked", 0)``, ``("length", n)`` or ``("none", 0)`` (requests)."""
        if self.has_token("Transfer-Encoding", "chunked"):
            return "chunked", 0
        length = self.get("Content-Length")
        if length is not None:
            return "length", int(length)
        return "none", 0


class _Connection:
    """Serves one client connection: read request, apply fault or forward, repeat."""

    def __init__(self, proxy: ProxySide, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.client_in = _Reader(client)
        self.upstream: socket.socket | None = None
        self.upstream_in: _Reader | None = None
        self.awaiting_first_byte = False  # set per request; cleared by the first reply byte
        self.bucket = TokenBucket(proxy.conn_rate) if proxy.conn_rate else None

    # All bytes to either peer go through here; bytes to the client are shaped.
    def send(self, sock: socket.socket, data: bytes) -> None:
        if sock is not self.client or not self.proxy.shaping:
            sock.sendall(data)
            return
        if self.awaiting_first_byte:
            self.awaiting_first_byte = False
            if self.proxy.latency > 0 and self.proxy._stop.wait(self.proxy.latency):
                raise _ClosedError("proxy stopping")
        buckets = [b for b in (self.bucket, self.proxy.total_bucket) if b is not None]
        view = memoryview(data)
        for start in range(0, len(view), _SHAPE_SLICE):
            piece = view[start : start + _SHAPE_SLICE]
            wait = max((b.reserve(len(piece)) for b in buckets), default=0.0)
            if wait > 0:
                time.sleep(wait)
            sock.sendall(piece)

    def run(self) -> None:
        try:
            while not self.proxy.stopping:
                raw = self.client_in.read_until(b"\r\n\r\n")
                if raw is None:
                    break
                if not self.handle(_Head(raw)):
                    break
        except (OSError, _ClosedError, ValueError) as exc:
            logger.debug("faultproxy connection ended: %r", exc)
        finally:
            self.close()

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                self.proxy._forget(sock)
                sock.close()

    def handle(self, req: _Head) -> bool:
        """Serve one request; returns whether the connection stays open."""
        method, _, rest = req.start.partition(" ")
        target = unquote(rest.rpartition(" ")[0])
        self.awaiting_first_byte = True
        rule = self.proxy._take(method, target, req.get("Range"))
        if rule is None and not self.proxy._rate_admits():
            self.drain_request_body(req)
            self.send(self.client, s3_error_response(503, "SlowDown", head_only=method == "HEAD"))
            return not req.has_token("Connection", "close") and not req.start.endswith("HTTP/1.0")
        if rule is None:
            return self.forward(req, method)
        logger.debug("faultproxy: %s on %s %s", rule.label, method, target)
        if rule.kind == "reset":
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if rule.kind in ("truncate", "corrupt", "hold", "headers"):
            return self.forward(req, method, fault=rule)
        self.drain_request_body(req)
        if rule.kind == "status":
            self.send(
                self.client,
                s3_error_response(rule.status, rule.error_code, head_only=method == "HEAD"),
            )
            return not req.has_token("Connection", "close") and not req.start.endswith("HTTP/1.0")
        self.hang()
        return False

    def hang(self) -> None:
        """Never answer: wait until the proxy stops or the client goes away."""
        while not self.proxy.stopping:
            readable, _, _ = select.select([self.client], [], [], _POLL)
            if readable and not self.client_in.read_all():
                return

    def expect_continue(self, req: _Head) -> None:
        """Answer ``Expect: 100-continue`` ourselves; upstream never sees the header."""
        expect = req.get("Expect")
        if expect is not None and expect.lower() == "100-continue":
            req.remove("Expect")
            self.send(self.client, b"HTTP/1.1 100 Continue\r\n\r\n")

    def drain_request_body(self, req: _Head) -> None:
        self.expect_continue(req)
        self.relay_body(self.client_in, None, req.body_framing())

    def drop_upstream(self) -> None:
        if self.upstream is not None:
            self.proxy._forget(self.upstream)
            self.upstream.close()
        self.upstream = self.upstream_in = None

    def connect_upstream(self) -> tuple[socket.socket, _Reader]:
        if self.upstream is not None and self.upstream_in is not None:
            # An idle keep-alive connection that is readable has been closed upstream.
            readable, _, _ = select.select([self.upstream], [], [], 0)
            if not readable:
                return self.upstream, self.upstream_in
            self.drop_upstream()
        sock = socket.create_connection(self.proxy.upstream, timeout=self.proxy.connect_timeout)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.proxy._track(sock)
        self.upstream, self.upstream_in = sock, _Reader(sock)
        return sock, self.upstream_in

    def forward(self, req: _Head, method: str, fault: FaultRule | None = None) -> bool:
        """Send the request upstream and relay the response; returns keep-alive."""
        upstream, upstream_in = self.connect_upstream()
        self.expect_continue(req)
        self.send(upstream, req.to_bytes())
        self.relay_body(self.client_in, upstream, req.body_framing())
        self.proxy._count_forwarded()
        while True:
            raw = upstream_in.read_until(b"\r\n\r\n")
            if raw is None:
                raise _ClosedError("upstream closed before responding")
            resp = _Head(raw)
            status = int(resp.start.split(" ", 2)[1])
            if status >= 200:
                break
            self.send(self.client, raw)  # 1xx informational: pass on, read the real one
        framing = resp.body_framing()
        if method == "HEAD" or status in (204, 304):
            framing = ("none", 0)
        elif framing[0] == "none":
            framing = ("eof", 0)
        client_wants_close = req.has_token("Connection", "close") or (
            req.start.endswith("HTTP/1.0") and not req.has_token("Connection", "keep-alive")
        )
        upstream_closes = framing[0] == "eof" or resp.has_token("Connection", "close")
        keep_client = upstream_closes and framing[0] != "eof" and not client_wants_close
        self.send(self.client, _head_for_client(resp, raw, fault, keep_alive=keep_client))
        held = 0
        if fault is not None and fault.kind == "hold" and framing[0] == "length":
            held = min(framing[1], fault.truncate_bytes or framing[1] // 2)
            self.relay_body(upstream_in, self.client, ("length", held))
            while not fault.released.wait(_POLL):
                if self.proxy.stopping:
                    raise _ClosedError("proxy stopping")
            framing = ("length", framing[1] - held)
        if fault is not None and fault.kind == "truncate":
            limit = fault.truncate_bytes
            if limit is None:
                limit = framing[1] // 2 if framing[0] == "length" else 1
            self.relay_body(upstream_in, self.client, framing, limit=limit)
            return False
        corrupt_at = None
        if fault is not None and fault.kind == "corrupt":
            corrupt_at = fault.corrupt_at
            if corrupt_at is None:
                corrupt_at = framing[1] // 2 if framing[0] == "length" else 0
        elif fault is not None and fault.kind == "hold" and fault.corrupt_at is not None:
            corrupt_at = fault.corrupt_at - held  # offset in the rest, sent after the release
        self.relay_body(upstream_in, self.client, framing, corrupt_at=corrupt_at)
        if upstream_closes:
            self.drop_upstream()
        return framing[0] != "eof" and not client_wants_close

    def relay_body(
        self,
        src: _Reader,
        dst: socket.socket | None,
        framing: tuple[str, int],
        limit: int | None = None,
        corrupt_at: int | None = None,
    ) -> None:
        """Copy one message body from ``src`` to ``dst`` (``None`` = discard).

        With ``limit``, stop after that many bytes (raw bytes for chunked bodies); with
        ``corrupt_at``, invert the bits of the byte at that offset (raw bytes likewise).
        """
        budget = [limit]
        sent = [0]

        def out(data: bytes) -> bool:
            if budget[0] is not None:
                data = data[: budget[0]]
                budget[0] -= len(data)
            if corrupt_at is not None and sent[0] <= corrupt_at < sent[0] + len(data):
                i = corrupt_at - sent[0]
                data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
            sent[0] += len(data)
            if dst is not None and data:
                self.send(dst, data)
            return budget[0] is None or budget[0] > 0

        kind, length = framing
        if kind == "length":
            left = length
            while left > 0:
                data = src.read_some(min(left, _RECV))
                left -= len(data)
                if not out(data):
                    return
        elif kind == "chunked":
            while True:
                line = src.read_until(b"\r\n")
                if line is None:
                    raise _ClosedError("connection closed mid-chunk")
                if not out(line):
                    return
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while True:  # trailers, ended by an empty line
                        trailer = src.read_until(b"\r\n")
                        if trailer is None:
                            raise _ClosedError("connection closed in trailers")
                        if not out(trailer):
                            return
                        if trailer == b"\r\n":
                            return
                left = size + 2  # data plus CRLF
                while left > 0:
                    data = src.read_some(min(left, _RECV))
                    left -= len(data)
                    if not out(data):
                        return
        elif kind == "eof":
            while data := src.read_all():
                if not out(data):
                    return


def _head_for_client(
    resp: _Head, raw: bytes, fault: FaultRule | None, *, keep_alive: bool
) -> bytes:
    """The response head as the client gets it. ``keep_alive``: werkzeug closes after every
    response; keep the client side alive like S3 does (a fresh upstream connection serves
    the next request). A ``headers`` fault replaces the headers it names."""
    if keep_alive:
        resp.remove("Connection")
    if fault is not None and fault.kind == "headers":
        for name, value in fault.set_headers.items():
            resp.remove(name)
            resp.headers.append((name, value))
    return resp.to_bytes() if keep_alive or (fault is not None and fault.kind == "headers") else raw
