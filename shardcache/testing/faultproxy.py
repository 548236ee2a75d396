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

The rules and their records are :mod:`shardcache.testing.fault_rules`, one connection's
relay :mod:`shardcache.testing.relay`, the buckets :mod:`shardcache._base.token_bucket`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter, deque

from shardcache._base.token_bucket import TokenBucket
from shardcache.testing._service import HOST, LoopbackService
from shardcache.testing.fault_rules import (
    FaultRule,
    FaultRules,
    InjectedFault,
    ProxyStats,
    parse_kind,
)
from shardcache.testing.relay import _POLL, _Connection

logger = logging.getLogger(__name__)


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

    def _take(self, method: str, target: str, byte_range: str | None = None) -> FaultRule | None:
        rule = self.rules.take(method, target, byte_range)
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
        set_headers: dict[str, str] | None = None,
        range_from: int | None = None,
    ) -> FaultRule:
        """Inject ``kind`` into the next ``times`` matching requests (``None`` = always).

        Kinds: ``"status:NNN"`` (S3 XML error, upstream not contacted), ``"reset"``
        (TCP RST instead of a response), ``"truncate"`` (headers plus ``truncate_bytes``
        of the body, default half, then close), ``"corrupt"`` (the whole response with the
        body byte at ``corrupt_at``, default the middle one, inverted), ``"hang"`` (never
        answer), ``"hold"`` (headers plus ``truncate_bytes`` of a body, default half, then
        the rest once the returned rule's ``release()`` was called; with ``corrupt_at``
        past the held part, that byte of the rest inverted), ``"headers"`` (the response
        with ``set_headers`` replacing its headers of those names: an object as another
        store or an encrypted object describes it). ``method``, ``path_contains``
        (substring of the decoded URL) and ``range_from`` (the first byte of the request's
        ``Range``: one part of a parallel download) narrow the match.
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
            set_headers=dict(set_headers or {}),
            range_from=range_from,
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
