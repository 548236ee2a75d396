"""The early-read offers of one fetch (SHARDCACHE_READ_WHILE_DOWNLOADING): which of its
downloads a reader may claim while it lands (:class:`~shardcache._store.growing.GrowingFile`),
and how a reader of a stopped attempt goes on in the published shard.

Invariant: only the first attempt of a fetch is offered; a later attempt (after a vanished
directory, a full disk) is offered to no one, and its pin is let go.
"""

from __future__ import annotations

from pathlib import Path

from .._disk.layout import CacheLayout
from .._store.growing import Announce, GrowingFile
from .._store.pins import pin


class Offers:
    """The early-readable downloads of one fetch, the first offered to ``announce``."""

    def __init__(self, announce: Announce) -> None:
        self._announce = announce
        self._first: GrowingFile | None = None

    def __call__(self, growing: GrowingFile) -> None:
        if self._first is None:
            self._first = growing
            self._announce(growing)
        else:
            growing.stopped(_NotOffered())  # nobody may claim it: its pin is let go

    def resumed(self, layout: CacheLayout, path: Path) -> bool:
        """Hand the published ``path`` to a reader of a stopped first attempt; False if
        it was gone before it could be pinned (then fetch again)."""
        first = self._first
        if first is None or not first.waits_for_resume():
            return True
        fd = pin(layout, path)
        if fd is None:
            return False
        first.resumed(fd)
        return True

    def failed(self, exc: BaseException) -> None:
        """The fetch failed: a reader of the first attempt gets ``exc``."""
        if self._first is not None:
            self._first.failed(exc)


def tell_failed(growing: GrowingFile | None, exc: BaseException) -> None:
    """Tell a download's early reader (if any) that this attempt failed with ``exc``."""
    if growing is not None:
        growing.stopped(exc)


class _NotOffered(Exception):
    """Why a later attempt's download cannot be claimed: its fetch offered an earlier one."""
