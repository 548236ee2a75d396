"""An HTTP/1.1-aware TCP proxy on 127.0.0.1 that injects S3 faults.

Sits between a client (s3fs / aiobotocore / boto3) and an upstream S3 server
(``S3Server``) and, for the next N requests matching a rule, answers with an S3 error
status, resets the connection, truncates or corrupts the response body, or hangs::

    with FaultProxy("127.0.0.1", s3.port) as proxy:
        proxy.add_fault("status:503", times=2, method="GET", path_contains="train-0001")
        fs = s3fs.S3FileSystem(**s3.storage_options(proxy.endpoint_url))

Each client connection gets one handler thread and one upstream connection; requests on
it are handled one after another (keep-alive and chunked bodies are supported).

It also shapes the link in user space (only the bytes sent *to the client*, i.e. the
download direction)::

    FaultProxy("127.0.0.1", s3.port, latency=0.04, conn_rate=10e6, total_rate=100e6)

``latency`` delays the first response byte of every request (time to first byte),
``conn_rate`` caps each client connection and ``total_rate`` all of them together
(bytes/s, token buckets).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

from shardcache.testing._service import HOST, LoopbackService

logger = logging.getLogger(__name__)

FAULT_KINDS = ("status", "reset", "truncate", "corrupt", "hang", "hold")
_RECV = 64 * 1024
_MAX_HEAD = 64 * 1024
_POLL = 0.05  # seconds between checks of the stop flag while hanging / accepting

# S3 error code and message per status for injected "status:NNN" faults.
_S3_ERRORS = {
    400: ("BadRequest", "Bad Request"),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    429: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    502: ("BadGateway", "Bad Gateway"),
    503: ("SlowDown", "Please reduce your request rate."),
    504: ("GatewayTimeout", "Gateway Timeout"),
}


_SHAPE_SLICE = 16 * 1024  # bytes sent per token-bucket reservation when shaping


class TokenBucket:
    """A thread-safe token bucket: :meth:`take` blocks until ``n`` bytes may pass.

    Callers reserve tokens (the balance may go negative) and then sleep off the debt, so
    concurrent takers share the rate fairly in arrival order. ``burst`` is the most that
    can pass at once after an idle period.
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(self.rate * 0.01, 64 * 1024)
        self._tokens = self.burst
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Take ``n`` tokens now; returns how long the caller must wait before sending."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            return -self._tokens / self.rate if self._tokens < 0 else 0.0

    def try_take(self, n: int = 1) -> bool:
        """Take ``n`` tokens if the bucket holds them now; never blocks or goes negative."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            if self._tokens < n:
                return False
            self._tokens -= n
            return True

    def take(self, n: int) -> None:
        """Block until ``n`` tokens are available."""
        wait = self.reserve(n)
        if wait > 0:
            time.sleep(wait)


class _ClosedError(Exception):
    """The peer closed the connection in the middle of a message."""


@dataclass
class FaultRule:
    """Apply ``kind`` to the next ``remaining`` requests matching method and path.

    ``remaining=None`` means every matching request, forever.
    """

    kind: str
    remaining: int | None = 1
    method: str | None = None
    path_contains: str | None = None
    status: int = 503
    truncate_bytes: int | None = None
    """Body bytes to forward before closing (``truncate``); default half the body."""
    corrupt_at: int | None = None
    """Offset of the body byte inverted (``corrupt``); default the middle of the body.
    With ``hold``, a byte after the held part inverted when the rest is sent; default none."""
    released: threading.Event = field(default_factory=threading.Event, repr=False)
    """``hold``: set it (:meth:`release`) to send the rest of the held bodies."""

    def release(self) -> None:
        """``hold``: send the rest of every body this rule holds back."""
        self.released.set()

    error_code: str | None = None
    """S3 error code in the XML body (``status``); default depends on the status."""
    injected: int = 0

    @property
    def label(self) -> str:
        """``"status:503"``, ``"reset"``, ``"truncate"``, ``"corrupt"`` or ``"hang"``."""
        return f"status:{self.status}" if self.kind == "status" else self.kind

    def matches(self, method: str, target: str) -> bool:
        """Whether this rule applies to a request (``target`` is the decoded URL)."""
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.method is not None and self.method.upper() != method.upper():
            return False
        return self.path_contains is None or self.path_contains in target


@dataclass(frozen=True)
class InjectedFault:
    """One fault the proxy applied."""

    kind: str
    method: str
    target: str


@dataclass(frozen=True)
class ProxyStats:
    """Snapshot of a proxy's counters."""

    connections: int
    requests: int
    forwarded: int
    faults: dict[str, int]
    injected: tuple[InjectedFault, ...]
    rate_passed: int = 0
    """Requests the request-rate limit (``max_request_rate``) let through."""
    rate_refused: int = 0
    """Requests it answered with 503 SlowDown."""


class FaultRules:
    """Thread-safe ordered list of fault rules; the first matching rule wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []

    def add(self, rule: FaultRule) -> FaultRule:
        """Append a rule and return it."""
        if rule.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {rule.kind!r}; expected one of {FAULT_KINDS}")
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule."""
        with self._lock:
            self._rules.clear()

    def pending(self) -> list[FaultRule]:
        """Rules that can still fire."""
        with self._lock:
            return [r for r in self._rules if r.remaining is None or r.remaining > 0]

    def take(self, method: str, target: str) -> FaultRule | None:
        """Consume one use of the first rule matching this request, if any."""
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, target):
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    rule.injected += 1
                    return rule
        return None


def parse_kind(kind: str) -> tuple[str, int]:
    """``"status:503"`` -> ``("status", 503)``; other kinds get status 0."""
    name, _, arg = kind.partition(":")
    if name == "status":
        if not arg.isdigit() or not 100 <= int(arg) <= 599:
            raise ValueError(f"bad status fault {kind!r}; expected e.g. 'status:503'")
        return name, int(arg)
    if name not in FAULT_KINDS or arg:
        raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
    return name, 0


def s3_error_response(status: int, code: str | None = None, head_only: bool = False) -> bytes:
    """A complete HTTP/1.1 response carrying an S3-style XML error."""
    default_code, message = _S3_ERRORS.get(
        status, ("InternalError" if status >= 500 else "InvalidRequest", "Injected fault")
    )
    request_id = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code or default_code}</Code><Message>{message}</Message>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        f"Date: {formatdate(usegmt=True)}\r\n"
        "Server: shardcache-faultproxy\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    ).encode()
    return head if head_only else head + body


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

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
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
        rule = self.proxy._take(method, target)
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
        if rule.kind in ("truncate", "corrupt", "hold"):
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
        if upstream_closes and framing[0] != "eof" and not client_wants_close:
            # werkzeug closes after every response; keep the client side alive like S3
            # does and open a fresh upstream connection for the next request instead.
            resp.remove("Connection")
            raw = resp.to_bytes()
        self.send(self.client, raw)
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


class FaultProxy(LoopbackService):
    """Threaded fault-injecting HTTP proxy on 127.0.0.1 in front of ``upstream``.

    Faults that answer by themselves (``status``, ``reset``, ``hang``) never reach the
    upstream server; ``truncate`` forwards the request and cuts the response body,
    ``corrupt`` forwards it and inverts one byte of the response body.

    Shaping (all off by default; applies to bytes sent to the client): ``latency``
    seconds before the first response byte of each request, ``conn_rate`` bytes/s per
    client connection, ``total_rate`` bytes/s over all connections together.

    ``host`` is the address it listens on: 127.0.0.1, or the host's address on a bridge
    to network namespaces the tests made (the SLURM nodes of ``scripts/slurm-local
    --nodes``), so that processes there reach the S3 server through it.

    ``max_request_rate`` plays an S3 prefix at its request limit: a token bucket of that
    many requests/s holding at most ``request_burst`` (default: one second's worth) lets
    requests through while it has a token and answers the others at once with ``503
    SlowDown`` and S3's XML error body, as S3 does; refused requests take no token. Fault
    rules are applied first. :meth:`stats` counts what it passed and refused.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        port: int = 0,
        connect_timeout: float = 10.0,
        latency: float = 0.0,
        conn_rate: float | None = None,
        total_rate: float | None = None,
        max_request_rate: float | None = None,
        request_burst: float | None = None,
        host: str = HOST,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._host = host
        self.request_bucket = (
            TokenBucket(max_request_rate, request_burst or max(1.0, max_request_rate))
            if max_request_rate
            else None
        )
        self._rate_passed = 0
        self._rate_refused = 0
        self.connect_timeout = connect_timeout
        if latency < 0 or (conn_rate is not None and conn_rate <= 0):
            raise ValueError("latency must be >= 0 and conn_rate positive")
        self.latency = float(latency)
        self.conn_rate = conn_rate
        self.total_rate = total_rate
        self.total_bucket = TokenBucket(total_rate) if total_rate else None
        self.rules = FaultRules()
        self._requested_port = port
        self._listener: socket.socket | None = None
        self._port: int | None = None
        self._accept_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Condition()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._connections = 0
        self._requests = 0
        self._forwarded = 0
        self._faults: Counter[str] = Counter()
        self._injected: deque[InjectedFault] = deque(maxlen=10_000)
        self._seen: Counter[tuple[str, str]] = Counter()

    # ------------------------------------------------------------------ lifecycle
    @property
    def shaping(self) -> bool:
        """Whether any latency or rate limit is set."""
        return bool(self.latency or self.conn_rate or self.total_bucket)

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` has been called."""
        return self._stop.is_set()

    def start(self) -> FaultProxy:
        """Bind 127.0.0.1 (or ``host``) and start accepting connections."""
        if self._listener is not None:
            return self
        self._stop.clear()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self._host, self._requested_port))
        listener.listen(128)
        listener.settimeout(_POLL)
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"faultproxy-accept-{self._port}", daemon=True
        )
        self._accept_thread.start()
        logger.info("fault proxy %s -> %s:%d", self.endpoint_url, *self.upstream)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close every socket and join every thread (bounded by ``timeout``); idempotent."""
        if self._listener is None:
            return
        deadline = time.monotonic() + timeout
        self._stop.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
            threads = list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            logger.warning("fault proxy: threads still running after stop(): %s", alive)
        self._listener = None
        self._accept_thread = None

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            client.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"faultproxy-conn-{self._port}", daemon=True
            )
            with self._lock:
                if self._stop.is_set():
                    client.close()
                    break
                self._connections += 1
                self._sockets.add(client)
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: _Connection) -> None:
        try:
            conn.run()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    # ------------------------------------------------------------------ bookkeeping
    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
            stopping = self._stop.is_set()
        if stopping:  # stop() already swept the sockets: make sure this one ends too
            sock.shutdown(socket.SHUT_RDWR)

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)

    def _take(self, method: str, target: str) -> FaultRule | None:
        rule = self.rules.take(method, target)
        with self._lock:
            self._requests += 1
            self._seen[method, target.partition("?")[0]] += 1
            if rule is not None:
                self._faults[rule.label] += 1
                self._injected.append(InjectedFault(rule.label, method, target))
                self._lock.notify_all()
        return rule

    def _rate_admits(self) -> bool:
        """Whether the request-rate limit (if any) lets one more request through now."""
        if self.request_bucket is None:
            return True
        admitted = self.request_bucket.try_take(1)
        with self._lock:
            if admitted:
                self._rate_passed += 1
            else:
                self._rate_refused += 1
        return admitted

    def _count_forwarded(self) -> None:
        with self._lock:
            self._forwarded += 1

    # ------------------------------------------------------------------ public API
    def add_fault(
        self,
        kind: str,
        times: int | None = 1,
        method: str | None = None,
        path_contains: str | None = None,
        *,
        truncate_bytes: int | None = None,
        corrupt_at: int | None = None,
        error_code: str | None = None,
    ) -> FaultRule:
        """Inject ``kind`` into the next ``times`` matching requests (``None`` = always).

        Kinds: ``"status:NNN"`` (S3 XML error, upstream not contacted), ``"reset"``
        (TCP RST instead of a response), ``"truncate"`` (headers plus ``truncate_bytes``
        of the body, default half, then close), ``"corrupt"`` (the whole response with the
        body byte at ``corrupt_at``, default the middle one, inverted), ``"hang"`` (never
        answer), ``"hold"`` (headers plus ``truncate_bytes`` of a body, default half, then
        the rest once the returned rule's ``release()`` was called; with ``corrupt_at``
        past the held part, that byte of the rest inverted). ``method``
        and ``path_contains`` (substring of the decoded URL) narrow the match.
        """
        name, status = parse_kind(kind)
        rule = FaultRule(
            kind=name,
            remaining=times,
            method=method,
            path_contains=path_contains,
            status=status or 503,
            truncate_bytes=truncate_bytes,
            corrupt_at=corrupt_at,
            error_code=error_code,
        )
        return self.rules.add(rule)

    def clear_faults(self) -> None:
        """Remove all fault rules (counters are kept)."""
        self.rules.clear()

    def stats(self) -> ProxyStats:
        """Counters so far: connections, requests seen, forwarded, faults by kind."""
        with self._lock:
            return ProxyStats(
                connections=self._connections,
                requests=self._requests,
                forwarded=self._forwarded,
                faults=dict(self._faults),
                injected=tuple(self._injected),
                rate_passed=self._rate_passed,
                rate_refused=self._rate_refused,
            )

    def requests_seen(self) -> Counter[tuple[str, str]]:
        """(method, decoded path without the query) -> how many such requests arrived,
        counted as each one arrives (before it is answered, faulted or forwarded)."""
        with self._lock:
            return Counter(self._seen)

    def faults_injected(self, kind: str | None = None) -> int:
        """How many faults were applied, optionally only of ``kind`` (e.g. ``"status:503"``)."""
        with self._lock:
            if kind is None:
                return sum(self._faults.values())
            return self._faults[kind]

    def wait_for_faults(self, count: int, kind: str | None = None, timeout: float = 10.0) -> None:
        """Block until at least ``count`` faults (of ``kind``) were applied, or raise."""

        def done() -> bool:
            total = sum(self._faults.values()) if kind is None else self._faults[kind]
            return total >= count

        with self._lock:
            if not self._lock.wait_for(done, timeout=timeout):
                raise TimeoutError(
                    f"fault proxy: fewer than {count} {kind or 'faults'} within {timeout}s"
                )
