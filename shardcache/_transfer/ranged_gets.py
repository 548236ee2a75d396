"""Reading an object in ranged GETs pinned to the version seen first (GCS: its generation;
Azure: If-Match on its ETag): the walk over the ranges, shared by the stores; each store
gives its GET of one range and says which of its errors mean the object changed."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

from .._base.errors import IntegrityError
from .._retry.throttle import Throttle, throttled_call
from .download import ObjectInfo


class RangedGets(NamedTuple):
    """How a store read in ranged GETs pinned to one version of an object (GCS, Azure)
    answers a range, and which of its errors say that the object changed."""

    get: Callable[[int, int], bytes]
    """Bytes ``[first, last)`` of the version read: one GET (fewer at the object's end)."""
    changed: Callable[[Exception], IntegrityError | None]
    """The error to raise for a GET that failed because the object changed, else None."""


def ranged_reads(
    info: ObjectInfo,
    piece: int,
    throttle: Throttle,
    gets: RangedGets,
    *,
    start: int = 0,
    end: int | None = None,
) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of an object (to ``info.size`` when ``end`` is None) in
    ranged GETs (``gets.get``) of at most ``piece`` bytes, each in a slot of ``throttle``;
    an empty answer is the object's end. An error that ``gets.changed`` turns into an
    :class:`IntegrityError` (the object changed since ``info``) is raised as that, any other
    as it is."""
    stop = info.size if end is None else end
    if stop is None:
        raise ValueError(f"{info.url}: a read to the end needs the object's size")
    pos = start
    while pos < stop:
        try:
            data = throttled_call(
                throttle, "GET", functools.partial(gets.get, pos, min(stop, pos + piece))
            )
        except Exception as exc:
            error = gets.changed(exc)
            if error is None:
                raise
            raise error from exc
        if not data:
            return
        yield data
        pos += len(data)


__all__ = ["RangedGets", "ranged_reads"]
