"""Fetching a shard's bytes from a peer: one signed HTTP range request, every wait bounded.

Blocking (the standard library's ``http.client``) in the fetching thread: a fetch runs in a
prefetch worker or a DataLoader worker, both synchronous and possibly forked, and a blocking
socket has no event loop to carry across a fork. The answer must start within ``timeout``
seconds of asking, connecting included (``SHARDCACHE_MESH_TIMEOUT``); then the whole body
must arrive before ``timeout + length / min_rate`` seconds, no pause longer than
``timeout``, each read bounded by what is left, so a peer that trickles cannot stretch the
wait. Every failure is a :class:`PeerFetchError` naming the peer and the bound: the caller
goes to the store.

Each thread keeps its connection to a peer open after an answer read whole (HTTP keep-alive),
for its next request there: no new connection a shard. A kept connection the peer closed
meanwhile is replaced once, at once; a forked child never uses its parent's.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from .._base.errors import PeerFetchError
from .auth import HEADER, JobKey
from .served import ShardRequest
from .server import PATH, RECORD_HEADER

_ERROR_TEXT = 512  # bytes of an error answer kept for the message

logger = logging.getLogger("shardcache.mesh")


@dataclass(frozen=True)
class Peer:
    """A node's mesh server."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Bounds:
    """How long a peer may take: ``timeout`` seconds from asking to the answer's first byte
    (connecting included) and at most that between pieces, and the slowest rate (bytes per
    second) its body may arrive at; ``chunk`` is the most read at once."""

    timeout: float = 2.0
    min_rate: float = 20e6
    chunk: int = 1 << 20


@dataclass(frozen=True)
class Answer:
    """What a peer gave: the bytes ``start`` to ``start + length`` of a copy of ``size``
    bytes, and the holder's ``record`` of that copy (size, checksum, ETag, version)."""

    start: int
    length: int
    size: int
    record: dict[str, Any]


def fetch_range(
    peer: Peer,
    key: JobKey,
    shard: ShardRequest,
    sink: Callable[[memoryview], object],
    *,
    start: int = 0,
    end: int | None = None,
    bounds: Bounds = Bounds(),
    on_answer: Callable[[Answer], object] | None = None,
) -> Answer:
    """Give ``sink`` the bytes ``start`` to ``end`` (inclusive; None: to the end) of
    ``shard``'s copy on ``peer``, in order, in pieces of at most ``bounds.chunk`` bytes;
    ``on_answer`` sees the answer (the holder's record) before the first byte."""
    byte_range = "" if start == 0 and end is None else f"bytes={start}-{'' if end is None else end}"
    target = f"{PATH}?{urlencode(shard.query())}"
    fail = _Failure(peer, shard.url, byte_range)
    connection, response = _answered(peer, key, target, byte_range, bounds=bounds, fail=fail)
    whole = False  # read to its end on a connection that stays open: kept for the next
    try:
        answer = _answer(response, byte_range, start, fail)
        if on_answer is not None:
            on_answer(answer)
        _receive(connection, response, sink, length=answer.length, bounds=bounds, fail=fail)
        whole = response.isclosed() and not response.will_close
        return answer
    finally:
        _kept.give_back(peer, connection, whole)


def _answered(
    peer: Peer, key: JobKey, target: str, byte_range: str, *, bounds: Bounds, fail: _Failure
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """The answer's head, on this thread's kept connection to ``peer`` or, when there is
    none or the peer closed it meanwhile, on a new one."""
    asked = time.monotonic()
    connection, kept = _kept.take(peer, bounds)
    try:
        return connection, _ask(connection, key, target, byte_range, bounds, asked)
    except _CLOSED as exc:
        connection.close()
        if not kept:
            raise fail("no answer", None, exc) from exc
        logger.debug("cache mesh: %s closed a kept connection (%s); asking on a new one", peer, exc)
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        raise fail(_no_answer(bounds), None, exc) from exc
    connection = http.client.HTTPConnection(peer.host, peer.port, timeout=bounds.timeout)
    try:
        return connection, _ask(connection, key, target, byte_range, bounds, asked)
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        raise fail(_no_answer(bounds), None, exc) from exc


def _no_answer(bounds: Bounds) -> str:
    return f"no answer within {bounds.timeout:g} s (SHARDCACHE_MESH_TIMEOUT)"


def _ask(  # noqa: PLR0917
    connection: http.client.HTTPConnection,
    key: JobKey,
    target: str,
    byte_range: str,
    bounds: Bounds,
    asked: float,
) -> http.client.HTTPResponse:
    """Send the signed request (connecting first on a new connection); the answer's head,
    within ``bounds.timeout`` of ``asked`` (a monotonic time)."""
    if connection.sock is None:
        connection.connect()
    assert connection.sock is not None
    left = asked + bounds.timeout - time.monotonic()
    if left <= 0:
        raise TimeoutError("connecting took the whole bound")
    connection.sock.settimeout(left)
    headers = {HEADER: key.sign("GET", target, byte_range)}
    if byte_range:
        headers["Range"] = byte_range
    connection.request("GET", target, headers=headers)
    return connection.getresponse()


class _Held:
    """A connection kept open for the next request to its peer; closed if dropped."""

    def __init__(self, connection: http.client.HTTPConnection) -> None:
        self.connection: http.client.HTTPConnection | None = connection

    def take(self) -> http.client.HTTPConnection | None:
        connection, self.connection = self.connection, None
        return connection

    def __del__(self) -> None:
        if self.connection is not None:
            self.connection.close()


class _Kept(threading.local):
    """This thread's connections kept open, one a peer. A forked child starts with none:
    its parent's sockets are not its to use (dropping its copies closes only its own
    descriptors)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.held: dict[Peer, _Held] = {}

    def take(self, peer: Peer, bounds: Bounds) -> tuple[http.client.HTTPConnection, bool]:
        """The kept connection to ``peer`` (True) or a new one, not connected yet (False)."""
        if self.pid != os.getpid():
            self.pid, self.held = os.getpid(), {}
        held = self.held.pop(peer, None)
        connection = None if held is None else held.take()
        if connection is not None and connection.sock is not None:
            return connection, True
        return http.client.HTTPConnection(peer.host, peer.port, timeout=bounds.timeout), False

    def give_back(self, peer: Peer, connection: http.client.HTTPConnection, whole: bool) -> None:
        """Keep ``connection`` for the next request to ``peer`` when its answer was read
        ``whole`` (the peer keeps it open too), else close it."""
        if whole and self.pid == os.getpid():
            self.held[peer] = _Held(connection)
        else:
            connection.close()


_kept = _Kept()
# What a kept connection the peer has closed meanwhile raises when asked on again.
_CLOSED = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def _answer(
    response: http.client.HTTPResponse, byte_range: str, start: int, fail: _Failure
) -> Answer:
    expected = 206 if byte_range else 200
    if response.status != expected:
        try:
            text = response.read(_ERROR_TEXT).decode("utf-8", "replace").strip()
        except (OSError, http.client.HTTPException):
            text = ""
        raise fail(f"answered {response.status} {text!r}", response.status, None)
    try:
        record = json.loads(response.getheader(RECORD_HEADER) or "")
        length = int(response.getheader("Content-Length") or "")
        if byte_range:
            span, _, total = (response.getheader("Content-Range") or "").partition("/")
            first, _, _last = span.removeprefix("bytes ").partition("-")
            size, given = int(total), int(first)
        else:
            size, given = length, 0
    except ValueError as exc:
        raise fail("answered without a usable record or length", response.status, exc) from exc
    if given != start or not isinstance(record, dict) or record.get("size") != size:
        raise fail(
            f"answered bytes from {given} of {size} (record {record!r})", response.status, None
        )
    return Answer(start, length, size, record)


def _receive(
    connection: http.client.HTTPConnection,
    response: http.client.HTTPResponse,
    sink: Callable[[memoryview], object],
    *,
    length: int,
    bounds: Bounds,
    fail: _Failure,
) -> None:
    deadline = time.monotonic() + bounds.timeout + length / bounds.min_rate
    buffer = memoryview(bytearray(min(bounds.chunk, max(length, 1))))
    received = 0
    assert connection.sock is not None
    while received < length:
        left = deadline - time.monotonic()
        if left <= 0:
            raise fail(f"sent {received} of {length} bytes within the deadline", 200, None)
        connection.sock.settimeout(min(bounds.timeout, left))
        try:
            count = response.readinto(buffer[: min(len(buffer), length - received)])
        except TimeoutError as exc:
            late = time.monotonic() >= deadline
            what = "within the deadline" if late else f"within {bounds.timeout:g} s of silence"
            raise fail(f"sent {received} of {length} bytes {what}", 200, exc) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise fail(f"broke off after {received} of {length} bytes", 200, exc) from exc
        if not count:
            raise fail(f"ended after {received} of {length} bytes", 200, None)
        sink(buffer[:count])
        received += count


@dataclass(frozen=True)
class _Failure:
    peer: Peer
    url: str
    byte_range: str

    def __call__(
        self, what: str, status: int | None, cause: BaseException | None
    ) -> PeerFetchError:
        asked = self.byte_range or "all bytes"
        seen = what if cause is None else f"{what}: {type(cause).__name__}: {cause}"
        return PeerFetchError(
            f"Peer {self.peer} of the cache mesh did not give {self.url} ({asked}): {seen}. "
            "The shard is fetched from the store instead; if this repeats, check that node "
            "is up and reachable from this one.",
            url=self.url,
            peer=str(self.peer),
            status=status,
            cause=cause,
        )
