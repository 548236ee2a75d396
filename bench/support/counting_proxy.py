"""A FaultProxy that counts what it relays: each request's method, path and response body
bytes, in the proxy's own process (B13 counts requests and bytes per epoch with it)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from bench.support.infra import CTX, stop_helper
from shardcache.testing import faultproxy


class _Counter:
    """Requests the proxy relayed: (method, path, response body bytes), and how many are
    still being served."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._records: list[tuple[str, str, int]] = []
        self._inflight = 0

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        with self._cond:
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def add(self, method: str, path: str, nbytes: int) -> None:
        with self._cond:
            self._records.append((method, path, nbytes))

    def take(self) -> list[tuple[str, str, int]]:
        """The records so far (once no request is being served, or after 10 s), forgotten."""
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0, timeout=10)
            records, self._records = self._records, []
        return records


class _CountingConnection(faultproxy._Connection):
    """A FaultProxy connection that counts the response body bytes it sends to the client
    (FaultProxy has no hook for it; this subclass is installed in the proxy's own process)."""

    def handle(self, req: Any) -> bool:
        method, _, rest = req.start.partition(" ")
        path = unquote(rest.rpartition(" ")[0]).partition("?")[0]
        self._body_bytes = 0
        self._in_body = False
        counter: _Counter = self.proxy.counter  # type: ignore[attr-defined]
        with counter.serving():
            try:
                return super().handle(req)
            finally:
                counter.add(method, path, self._body_bytes)

    def relay_body(self, src: Any, dst: Any, framing: Any, **kw: Any) -> None:
        self._in_body = dst is self.client
        try:
            super().relay_body(src, dst, framing, **kw)
        finally:
            self._in_body = False

    def send(self, sock: Any, data: bytes) -> None:
        super().send(sock, data)
        if getattr(self, "_in_body", False) and sock is self.client:
            self._body_bytes += len(data)


def _proxy_main(upstream_port: int, conn: Any) -> None:
    faultproxy._Connection = _CountingConnection  # type: ignore[misc]  # this process only
    proxy = faultproxy.FaultProxy("127.0.0.1", upstream_port)
    proxy.counter = _Counter()  # type: ignore[attr-defined]
    with proxy:
        conn.send(proxy.port)
        while conn.recv() == "take":
            conn.send(proxy.counter.take())  # type: ignore[attr-defined]


@contextlib.contextmanager
def counting_proxy(upstream_port: int) -> Iterator[tuple[str, Any]]:
    """An unshaped counting FaultProxy in its own process: yields (endpoint, take) where
    ``take()`` returns the (method, path, body bytes) of the requests since the last call."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_proxy_main, args=(upstream_port, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("counting proxy did not start")
        port = parent.recv()

        def take() -> list[tuple[str, str, int]]:
            parent.send("take")
            return parent.recv()

        yield f"http://127.0.0.1:{port}", take
    finally:
        stop_helper(parent, proc)
