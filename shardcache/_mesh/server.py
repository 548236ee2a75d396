"""``MeshServer``: a node's published shards served to the job's other nodes.

aiohttp runs in a background thread with its own event loop, on one listening socket bound
to the address it is given (the cluster interface; never a wildcard). ``GET /v1/shard``
answers a signed request (:mod:`shardcache._mesh.auth`) for one shard (:mod:`.served`),
whole or one byte range, with ``loop.sendfile`` on the descriptor :mod:`.served` opened (the
kernel's ``sendfile`` where the loop allows it, as aiohttp's ``FileResponse`` does). At most
``concurrency`` transfers run at once (more are answered 503 at once), and ``upload_rate``
caps the bytes per second of all of them together. An open descriptor keeps a copy's bytes
readable while it is sent even if eviction removes the file meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import weakref
from collections import Counter
from typing import Any

from aiohttp import web

from .._base.token_bucket import TokenBucket
from .auth import HEADER, Verifier
from .served import NotServed, ServedShards, ShardRequest

logger = logging.getLogger("shardcache.mesh")

PATH = "/v1/shard"
RECORD_HEADER = "X-Shardcache-Record"
_PACE_MAX, _PACE_MIN = 1 << 20, 64 << 10  # bytes per sendfile call when the upload is capped
_PACE_GAP = 0.05  # seconds of the cap one call sends at most (within the bounds above)
_START_TIMEOUT = 10.0  # seconds for the thread to start listening


class ByteRange:
    """A single ``Range: bytes=...`` of a file of ``size`` bytes, as ``offset`` and
    ``count``; ``partial`` when the answer is 206."""

    def __init__(self, header: str, size: int) -> None:
        self.offset, self.count, self.partial = 0, size, False
        if not header:
            return
        unit, _, spec = header.partition("=")
        first, dash, last = spec.strip().partition("-")
        if unit.strip() != "bytes" or not dash or "," in spec:
            raise NotServed(416, f"only one byte range is served, got {header!r}")
        try:
            if not first:  # the last N bytes
                start, end = max(size - int(last), 0), size - 1
            else:
                start = int(first)
                end = min(int(last), size - 1) if last else size - 1
        except ValueError:
            raise NotServed(416, f"not a byte range: {header!r}") from None
        if start < 0 or start >= size or end < start:
            raise NotServed(416, f"range {header!r} is outside the {size} bytes held")
        self.offset, self.count, self.partial = start, end - start + 1, True

    def content_range(self, size: int) -> str:
        return f"bytes {self.offset}-{self.offset + self.count - 1}/{size}"


class MeshServer:
    """Serves ``shards`` to requests ``verifier`` accepts, on ``host:port`` (0: the kernel
    picks; :attr:`port` says which). :meth:`start` and :meth:`stop` are bounded."""

    def __init__(
        self,
        shards: ServedShards,
        verifier: Verifier,
        host: str,
        port: int = 0,
        *,
        concurrency: int = 8,
        upload_rate: float | None = None,
    ) -> None:
        self._shards = shards
        self._verifier = verifier
        self._host = host
        self._requested_port = port
        self._concurrency = concurrency
        # Small steps keep the gaps between them short: a receiver's per-read bound is seconds.
        self._pace = int(max(_PACE_MIN, min(_PACE_MAX, (upload_rate or 0) * _PACE_GAP)))
        self._bucket = TokenBucket(upload_rate, self._pace) if upload_rate else None
        self._active = 0  # touched only in the server's loop
        self._counts: Counter[str] = Counter()
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()  # touched only in the loop
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._in_flight = 0  # requests being answered, counted before they are done
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    def counts(self) -> dict[str, int]:
        """Requests by answer (``"200"``, ``"206"``, ``"401"``, ...), transfers the peer
        ``"aborted"``, ``"bytes"`` served, ``"throttled_ms"`` waited on the upload cap, and
        the ``"connections"`` peers made."""
        with self._lock:
            return dict(self._counts)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is being answered (its counts then final), at most
        ``timeout`` seconds; whether it is so."""
        with self._settled:
            return self._settled.wait_for(lambda: self._in_flight == 0, timeout)

    def _count(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[key] += amount

    def start(self) -> MeshServer:
        """Listen and serve in a daemon thread; raises what stopped it from listening."""
        sock = socket.create_server((self._host, self._requested_port), backlog=128)
        self.port = sock.getsockname()[1]
        ready, failure = threading.Event(), []
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._listen(sock))
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                sock.close()
                self._loop.close()
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(
            target=run, name=f"shardcache-mesh-{self.port}", daemon=True
        )
        self._thread.start()
        if not ready.wait(_START_TIMEOUT):
            raise TimeoutError(
                f"the mesh server on {self.address} did not start in {_START_TIMEOUT} s"
            )
        if failure:
            raise failure[0]
        logger.info("cache mesh serving on %s", self.address)
        return self

    async def _listen(self, sock: socket.socket) -> None:
        app = web.Application()
        app.router.add_get(PATH, self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop listening, end the transfers under way, and end the thread (bounded)."""
        loop, runner, thread = self._loop, self._runner, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        for ending in (runner.cleanup() if runner else None, loop.shutdown_default_executor()):
            if ending is not None:  # the listener and transfers, then the file-opening threads
                future = asyncio.run_coroutine_threadsafe(ending, loop)
                with contextlib.suppress(Exception):
                    future.result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def __enter__(self) -> MeshServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if transport is not None and transport not in self._connections:  # a new connection
            self._connections.add(transport)
            self._count("connections")
        with self._settled:
            self._in_flight += 1
        try:
            return await self._answer(request)
        finally:
            with self._settled:
                self._in_flight -= 1
                self._settled.notify_all()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        byte_range = request.headers.get("Range", "")
        refused = self._verifier.check(
            "GET", request.raw_path, byte_range, request.headers.get(HEADER)
        )
        if refused is not None:
            status = 401 if refused == "unsigned request" else 403
            logger.warning("cache mesh refused a request from %s: %s", request.remote, refused)
            return self._refuse(status, refused)
        if self._active >= self._concurrency:
            return self._refuse(503, f"{self._active} transfers under way; ask the store")
        self._active += 1
        try:
            return await self._send(request, byte_range)
        except NotServed as not_served:
            return self._refuse(not_served.status, not_served.reason)
        finally:
            self._active -= 1

    def _refuse(self, status: int, reason: str) -> web.Response:
        self._count(str(status))
        return web.Response(status=status, text=reason + "\n")

    async def _send(self, request: web.Request, byte_range: str) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        wanted = ShardRequest.from_query(request.query)
        served = await loop.run_in_executor(None, self._shards.open, wanted)
        with open(served.fd, "rb", buffering=0) as file:
            chosen = ByteRange(byte_range, served.size)
            response = web.StreamResponse(status=206 if chosen.partial else 200)
            response.content_length = chosen.count
            response.content_type = "application/octet-stream"
            response.headers["Accept-Ranges"] = "bytes"
            response.headers[RECORD_HEADER] = served.record_header()
            if chosen.partial:
                response.headers["Content-Range"] = chosen.content_range(served.size)
            await response.prepare(request)  # a StreamResponse sends its headers at once
            try:
                await self._send_body(request, file, chosen.offset, chosen.count)
            except ConnectionError:  # the peer went away: aiohttp's end of the answer is quiet
                self._count("aborted")
                return response
            await response.write_eof()
        self._count(str(response.status))
        return response

    async def _send_body(self, request: web.Request, file: Any, offset: int, count: int) -> None:
        loop, transport = asyncio.get_running_loop(), request.transport
        if transport is None:
            raise ConnectionResetError("the peer went away before the body was sent")
        end = offset + count
        while offset < end:
            step = end - offset if self._bucket is None else min(self._pace, end - offset)
            if self._bucket is not None:
                wait = self._bucket.reserve(step)
                if wait > 0:
                    self._count("throttled_ms", round(wait * 1000))
                    await asyncio.sleep(wait)
            if transport.is_closing():
                raise ConnectionResetError("the peer went away during the body")
            await loop.sendfile(transport, file, offset, step)
            offset += step
            self._count("bytes", step)
