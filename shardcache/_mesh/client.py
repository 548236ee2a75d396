"""Fetching a shard's bytes from a peer: one signed HTTP range request, every wait bounded.

Blocking (the standard library's ``http.client``) in the fetching thread: a fetch runs in a
prefetch worker or a DataLoader worker, both synchronous and possibly forked, and a blocking
socket has no event loop to carry across a fork. The connection must open within
``connect`` seconds and the answer start within ``first_byte``; then the whole body must
arrive before ``first_byte + length / min_rate`` seconds, each read bounded by what is left,
so a peer that trickles cannot stretch the wait. Every failure is a :class:`PeerFetchError`
naming the peer: the caller goes to the store.
"""

from __future__ import annotations

import http.client
import json
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


@dataclass(frozen=True)
class Peer:
    """A node's mesh server."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Bounds:
    """How long a peer may take: to connect, to start answering, and the slowest rate
    (bytes per second) its body may arrive at; ``chunk`` is the most read at once."""

    connect: float = 1.0
    first_byte: float = 2.0
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
    connection = http.client.HTTPConnection(peer.host, peer.port, timeout=bounds.connect)
    try:
        try:
            connection.connect()
            assert connection.sock is not None
            connection.sock.settimeout(bounds.first_byte)
            headers = {HEADER: key.sign("GET", target, byte_range)}
            if byte_range:
                headers["Range"] = byte_range
            connection.request("GET", target, headers=headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise fail("no answer", None, exc) from exc
        answer = _answer(response, byte_range, start, fail)
        if on_answer is not None:
            on_answer(answer)
        _receive(connection, response, sink, length=answer.length, bounds=bounds, fail=fail)
        return answer
    finally:
        connection.close()


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
    deadline = time.monotonic() + bounds.first_byte + length / bounds.min_rate
    buffer = memoryview(bytearray(min(bounds.chunk, max(length, 1))))
    received = 0
    assert connection.sock is not None
    while received < length:
        left = deadline - time.monotonic()
        if left <= 0:
            raise fail(f"sent {received} of {length} bytes within the deadline", 200, None)
        connection.sock.settimeout(min(bounds.first_byte, left))
        try:
            count = response.readinto(buffer[: min(len(buffer), length - received)])
        except TimeoutError as exc:
            late = time.monotonic() >= deadline
            what = "within the deadline" if late else f"within {bounds.first_byte:g} s of silence"
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
