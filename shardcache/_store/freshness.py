"""Is a cached copy still its source's current content?

- Local sources (paths, ``file:`` URLs) are revalidated on every hit: the source's size and
  modification time (one ``stat``) against those recorded when the copy was made. The
  record is read from the shard's metadata once per published copy (a republish is a new
  inode) and remembered in the process (up to ``RECORDED_LIMIT`` shards, then read again).
- Remote sources are immutable by default: a hit costs nothing more. With
  ``SHARDCACHE_REVALIDATE=<interval>`` a hit last checked longer ago than the interval asks
  the store (one HEAD) whether its ETag, size or version changed; the check time is kept in
  the metadata, so the interval holds per shard across processes. A store that cannot be
  reached then serves the copy, with a warning.
- ``pipe:`` commands cannot be asked: their output is cached for good.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from .._base.errors import FetchError
from .._base.redact import get_logger
from .._base.url_kinds import LOCAL_PROTOCOLS, local_path
from .._disk.layout import CacheLayout, ShardId
from .._disk.metadata import read_meta, write_meta
from .._transfer.remote import ObjectInfo, Remote

logger = get_logger(__name__)

RECORDED_LIMIT = 65_536  # local-source stamps remembered per cache (oldest dropped first)


class Freshness:
    """Judges hits for one cache (its layout, remote and ``revalidate`` interval), the
    stamps of at most ``recorded_limit`` local sources remembered."""

    def __init__(
        self,
        layout: CacheLayout,
        remote: Remote,
        revalidate: float,
        *,
        recorded_limit: int = RECORDED_LIMIT,
    ) -> None:
        self.layout = layout
        self.remote = remote
        self.revalidate = revalidate
        self.recorded_limit = recorded_limit
        # cached path -> (its inode, the source's (size, mtime_ns) recorded for that copy)
        self._recorded: dict[Path, tuple[int, tuple[int, int] | None]] = {}
        self._lock = threading.Lock()

    def is_current(self, shard: ShardId, st: os.stat_result, *, ask_store: bool) -> bool:
        """May the cached copy of ``shard`` (``st``: its lstat) be served? ``ask_store``
        allows a HEAD (the hit path); waits for a lock and re-checks under it pass False
        and then accept only a copy checked within the interval."""
        if shard.protocol in LOCAL_PROTOCOLS:
            return self._local_is_current(shard.url, shard.data_path, st)
        if not self.revalidate or shard.protocol == "pipe":
            return True
        return self._remote_is_current(shard.url, shard.data_path, ask_store)

    # -- local sources -----------------------------------------------------------------

    def _local_is_current(self, url: str, final: Path, st: os.stat_result) -> bool:
        try:
            source = os.stat(local_path(url))
        except OSError:
            return False  # gone or unreadable: the miss path raises the right error
        return self._recorded_stamp(final, st) == (source.st_size, source.st_mtime_ns)

    def _recorded_stamp(self, final: Path, st: os.stat_result) -> tuple[int, int] | None:
        with self._lock:
            known = self._recorded.get(final)
        if known is not None and known[0] == st.st_ino:
            return known[1]
        meta = read_meta(self.layout, final)
        size, mtime_ns = meta.get("size"), meta.get("mtime_ns")
        stamp = (size, mtime_ns) if isinstance(size, int) and isinstance(mtime_ns, int) else None
        if meta.get("data_ino") not in (None, st.st_ino):
            stamp = None  # the record of a new copy written just before it replaces this one
        with self._lock:
            if final not in self._recorded and len(self._recorded) >= self.recorded_limit:
                del self._recorded[next(iter(self._recorded))]  # the oldest remembered
            self._recorded[final] = (st.st_ino, stamp)
        return stamp

    # -- remote sources ----------------------------------------------------------------

    def _remote_is_current(self, url: str, final: Path, ask_store: bool) -> bool:
        meta = read_meta(self.layout, final)
        checked = meta.get("checked_at", meta.get("fetched_at"))
        if isinstance(checked, int | float) and time.time() - checked < self.revalidate:
            return True
        if not ask_store:
            return False
        try:
            info = self.remote.info(url)
        except FetchError as exc:
            if isinstance(exc, FileNotFoundError):
                return False  # deleted at the source: the miss path reports it
            logger.warning(
                "cannot revalidate %s (%s); serving the cached copy fetched at %s",
                url,
                exc,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta.get("fetched_at", 0))),
            )
            return True
        if any(meta.get(key) != value for key, value in _version(info).items()):
            logger.info("%s changed at the source (ETag/size/version); fetching it again", url)
            return False
        write_meta(self.layout, final, {**meta, "checked_at": time.time()})
        return True


def _version(info: ObjectInfo) -> dict[str, Any]:
    return {"size": info.size, "etag": info.etag, "version_id": info.version_id}
