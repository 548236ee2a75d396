"""Space of one cache scope: room made for a download (evicting least-recently-used shards
within SHARDCACHE_MAX_BYTES and the disk), the full-disk error with its numbers, the
reservation of a download's size, dead downloads' leftovers removed, explicit eviction and
removal, and the accounting behind them (the scope's index, or a listing of the directory).

Invariant: published + reserved in-flight bytes never exceed SHARDCACHE_MAX_BYTES; room is
made, and counted, only under the scope's eviction lock (:func:`evict_lock`).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._base.errors import CacheDirError, CacheFullError, ConfigError
from .._base.fsinfo import Mount, mount_for
from .._base.redact import get_logger
from .._disk.layout import CacheLayout
from .eviction import CacheEntry, EvictReport, evict_lock, evict_locked, evict_lru, remove, scan
from .index import Index
from .leftovers import remove_dead_parts

if TYPE_CHECKING:
    from .._config.settings import Settings
    from .._transfer.download import ObjectInfo

logger = get_logger("shardcache._cache")  # the cache's records keep one logger name
_T = TypeVar("_T")


class Space:
    """The space accounting of the scope laid out as ``layout``, bounded by ``settings``;
    ``mount_for(path)`` tells which file system a path is on, ``disk_usage(path)`` how much
    of it is free (as :func:`shutil.disk_usage`)."""

    def __init__(
        self,
        layout: CacheLayout,
        settings: Settings,
        *,
        mount_for: Callable[[Path], Mount] = mount_for,
        disk_usage: Callable[[Path], Any] = shutil.disk_usage,
    ) -> None:
        self._layout = layout
        self._settings = settings
        self._mount_for = mount_for
        self._disk_usage = disk_usage
        self._network_fs: bool | None = None
        self._index: Index | None = None
        self._index_failed = False  # the index failed once: this process lists instead

    @property
    def bounded(self) -> bool:
        """Whether SHARDCACHE_MAX_BYTES bounds the scope."""
        return self._settings.max_bytes is not None

    # -- making room -----------------------------------------------------------------

    def make_room(self, final: Path, info: ObjectInfo, *, on_disk: bool = False) -> None:
        """Evict least-recently-used shards so ``info`` fits within SHARDCACHE_MAX_BYTES
        and on the disk; CacheFullError (with the numbers) when it cannot. The caller
        holds :func:`evict_lock`. ``on_disk``: the bytes are already downloaded into a
        ``.part``, which the evictor's count includes (and the disk already holds)."""
        max_bytes = self._settings.max_bytes
        size = info.size or 0
        if max_bytes is not None:
            if size > max_bytes:
                raise self.full_error(
                    final, info, f"the shard alone exceeds SHARDCACHE_MAX_BYTES={max_bytes}"
                )
            reserve = 0 if on_disk else size
            report = self._evict_locked(max_bytes, reserve)
            if report.kept_bytes + reserve > max_bytes:
                raise self.full_error(
                    final,
                    info,
                    f"the cache holds {report.kept_bytes} of SHARDCACHE_MAX_BYTES={max_bytes} "
                    f"bytes and nothing more is evictable ({report.in_use} shards, "
                    f"{report.in_use_bytes} bytes, are in use by live processes; the rest is "
                    "downloads in progress)",
                    report,
                )
        free = self._free_bytes(final.parent)
        if on_disk or free >= size:
            return
        used = self._used_bytes()
        report = self._evict_locked(max(0, used - (size - free)), 0)
        free = self._free_bytes(final.parent)
        if free < size:
            raise self.full_error(
                final,
                info,
                f"only {free} bytes are free on the disk after evicting {report.freed_bytes} "
                f"bytes ({report.in_use} shards, {report.in_use_bytes} bytes, are in use and "
                "could not be evicted)",
                report,
            )

    def full_error(
        self, final: Path, info: ObjectInfo, seen: str, report: EvictReport | None = None
    ) -> CacheFullError:
        """No room for ``info`` at ``final``: ``seen`` says why (``report``: what eviction did)."""
        free = self._free_bytes(final.parent)
        return CacheFullError(
            f"no room to cache {info.url} ({info.size} bytes needed) in {final.parent}: "
            f"{seen}. Free disk space, set SHARDCACHE_MAX_BYTES below the disk size, or point "
            "SHARDCACHE_DIR at a larger node-local disk. Nothing partial was left behind.",
            url=info.url,
            path=str(final.parent),
            needed=info.size,
            free=free,
            max_bytes=self._settings.max_bytes,
            evictable=0 if report else None,  # with a report, every evictable shard is gone
            in_use=report.in_use if report else 0,
            in_use_bytes=report.in_use_bytes if report else 0,
        )

    def reserve(self, fd: int, info: ObjectInfo) -> None:
        """Reserve the download's full size (SHARDCACHE_PREALLOCATE=auto, local disks): a full
        disk then fails before any byte is fetched, and the evictor counts this download at
        its full size. Not on network file systems, where glibc would emulate it by writing
        zeros; a file system that cannot reserve (EOPNOTSUPP, EINVAL) downloads unreserved."""
        if not info.size:
            return
        # The apparent size is what the evictor counts (a sparse file takes no blocks).
        os.ftruncate(fd, info.size)
        if self._settings.preallocate == "off" or self._on_network_fs():
            return
        try:
            os.posix_fallocate(fd, 0, info.size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            logger.debug("cannot reserve space for %s (%s); downloading unreserved", info.url, exc)

    # -- the index's part in a download ------------------------------------------------

    def add_part(self, part: Path, final: Path) -> None:
        """Count the download ``part`` (of ``final``) in the index, if kept (under the lock)."""
        self._index_call(lambda index: index.add_part(part, final))

    def published(self, part: Path, final: Path) -> None:
        """``part`` was renamed to ``final``: the index counts a shard (under the lock)."""
        self._index_call(lambda index: index.published(part, final))

    def remove_leftovers(self, directory: Path) -> None:
        """Remove the temp files dead writers of this host left in the data directory
        ``directory`` (a miss into it, under its shard's lock). A process that keeps the
        index removes them when it makes room instead (:meth:`Index.evict`), listing no
        directory."""
        if self.index() is None:
            remove_dead_parts(self._layout, directory)

    # -- maintenance -----------------------------------------------------------------

    def entries(self) -> list[CacheEntry]:
        """Published shards of the scope, least recently used first, with their URLs."""
        return scan(self._layout, with_meta=True)[0]

    def evict(self, max_bytes: int | None) -> EvictReport:
        """Evict down to ``max_bytes`` (default SHARDCACHE_MAX_BYTES): :meth:`ShardCache.evict`."""
        limit = self._settings.max_bytes if max_bytes is None else max_bytes
        if limit is None:
            raise ConfigError(
                "evict needs a size: pass max_bytes or set SHARDCACHE_MAX_BYTES (e.g. 500G).",
                name="max_bytes",
                value=None,
            )
        if self._on_network_fs():
            return evict_lru(self._layout, limit)
        index = self.index(always=True)
        assert index is not None
        with evict_lock(self._layout):
            # Asked for explicitly (the CLI): exact, even if processes without max_bytes
            # (which do not keep the index) published meanwhile.
            index.rebuild()
            return index.evict(limit)

    def remove(self, path: Path) -> bool:
        """Remove a published shard and its metadata; False if missing or in use. Also
        from the scope's index when there is one (``verify`` runs without max_bytes)."""
        index = self.index(always=self._layout.fs_exists(self._layout.index_path))
        if index is None:
            return remove(self._layout, path)
        with evict_lock(self._layout):
            removed = remove(self._layout, path)
            if removed:
                index.forget(path)
            return removed

    # -- accounting (the index, or a listing of the directory) ---------------------------

    def index(self, *, always: bool = False) -> Index | None:
        """The scope's index when this process keeps it: SHARDCACHE_MAX_BYTES set (or
        ``always``: an explicit evict) and a local disk (see :mod:`shardcache._store.index`)."""
        if (self._settings.max_bytes is None and not always) or self._on_network_fs():
            return None
        if self._index_failed:
            return None
        if self._index is None:
            self._index = Index(self._layout)
        return self._index

    def _index_call(
        self, op: Callable[[Index], _T], fallback: Callable[[], _T] | None = None
    ) -> Any:
        """``op`` on the index when this process keeps one, else ``fallback``. The index is
        an optimisation: if it fails (its directory removed under us by a tmp cleaner, a
        lock held beyond its timeout), this process lists the directory from then on, as
        before the index, and says so once; a damaged file is rebuilt, not a failure."""
        index = self.index()
        if index is not None:
            try:
                return op(index)
            except CacheDirError as exc:
                logger.warning(
                    "%s; this process lists the cache directory instead from now on",
                    exc.message,
                )
                index.invalidate()
                self._index_failed = True
        return fallback() if fallback is not None else None

    def _evict_locked(self, max_bytes: int, reserve: int) -> EvictReport:
        """Evict to ``max_bytes`` with room for ``reserve`` (the caller holds evict_lock)."""
        return self._index_call(
            lambda index: index.evict(max_bytes, reserve),
            lambda: evict_locked(self._layout, max_bytes, reserve=reserve),
        )

    def _used_bytes(self) -> int:
        """Published bytes plus downloads in progress (the caller holds evict_lock)."""

        def listed() -> int:
            entries, partial = scan(self._layout)
            return partial + sum(e.size for e in entries)

        return self._index_call(lambda index: index.used_bytes(), listed)

    def _on_network_fs(self) -> bool:
        if self._network_fs is None:
            self._network_fs = self._mount_for(self._settings.scope_dir).is_network
        return self._network_fs

    def _free_bytes(self, path: Path) -> int:
        """Free bytes on the file system of ``path``, or of its nearest existing ancestor."""
        for candidate in (path, *path.parents):
            try:
                return self._disk_usage(candidate).free
            except FileNotFoundError:
                continue
        return 0
