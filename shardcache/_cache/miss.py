"""The miss path of a fetch, a chain of steps that each hand off to the next:

    fetch -> handling vanished files -> under the shard's lock -> from a peer of the mesh
          (:mod:`~shardcache._cache.peer_fill`, when the cache has peers) -> handling a full
          disk -> download once (into a private temp file, verified, published)

Every step recreates what it needs, so a miss is made again when the cache's own
directories or files vanish under it (tmp cleaners, a user's ``rm -rf``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from .._base.errors import CacheDirError, CacheFullError
from .._base.redact import get_logger
from .._config.settings import Settings
from .._disk.layout import CacheLayout, ShardId
from .._observe import metrics
from .._store.eviction import evict_lock
from .._store.growing import Announce, GrowingFile
from .._store.hits import Hits
from .._store.publish import (
    SIZE_ONLY,
    VANISHED_RETRIES,
    DiskFull,
    Publisher,
    Vanished,
    verified_method,
)
from .._store.space import Space
from .._transfer.download import REQUESTING
from .._transfer.remote import ObjectInfo, OpenedObject, Progress, Remote
from .locks import CacheLocks
from .offers import Offers, tell_failed
from .peer_fill import PeerFill
from .size_only import published_by_size
from .stats import StatsCounter

logger = get_logger("shardcache._cache")  # the cache's records keep one logger name


class MissPath:
    """Fetches a shard that is not cached (its identity known, its hit check failed)."""

    def __init__(
        self,
        settings: Settings,
        layout: CacheLayout,
        remote: Remote,
        *,
        hits: Hits,
        locks: CacheLocks,
        space: Space,
        publisher: Publisher,
        stats: StatsCounter,
        peers: PeerFill | None = None,
    ) -> None:
        self._settings = settings
        self._layout = layout
        self._remote = remote
        self._hits = hits
        self._locks = locks
        self._space = space
        self._publisher = publisher
        self._stats = stats
        self.peers = peers  # the cache mesh's step, when the cache has peers

    def fetch(self, shard: ShardId, progress: Progress | None, announce: Announce | None) -> Path:
        """Fetch ``shard``; ``announce`` (if given) gets the :class:`GrowingFile` of a
        download this process makes, once its first bytes landed."""
        offers = Offers(announce) if announce is not None else None
        try:
            return self._fetch_handling_vanished(shard, progress, offers)
        except BaseException as exc:
            if offers is not None:
                offers.failed(exc)
            raise

    def _fetch_handling_vanished(
        self, shard: ShardId, progress: Progress | None, offers: Offers | None
    ) -> Path:
        attempt = 0
        while True:
            attempt += 1
            try:
                path = self._fetch_under_lock(shard, progress, offers)
                if offers is None or offers.resumed(self._layout, path):
                    return path
                raise Vanished(path)  # gone again before its reader could go on in it
            except Vanished as exc:
                if attempt == VANISHED_RETRIES:
                    raise CacheDirError(
                        f"cannot cache {shard.url}: the cache's files kept disappearing while it "
                        f"was being fetched ({attempt} attempts; last: {exc.path} vanished). "
                        f"Something is deleting {self._settings.scope_dir} (a tmp cleaner such "
                        "as systemd-tmpfiles, a job epilogue): exclude it, or point "
                        "SHARDCACHE_DIR elsewhere.",
                        path=str(exc.path),
                        url=shard.url,
                        attempts=attempt,
                    ) from exc
                logger.warning(
                    "%s vanished while caching %s (removed by a tmp cleaner?); fetching again",
                    exc.path,
                    shard.url,
                )

    def _fetch_under_lock(
        self, shard: ShardId, progress: Progress | None, offers: Offers | None
    ) -> Path:
        """Lock, re-check (another process may have published it), download, count."""
        url, final = shard.url, shard.data_path
        for directory in (final.parent, shard.lock_path.parent):
            # On every miss, made again if removed (a tmp cleaner), checked before and after
            # mkdir: a link or a foreign directory planted inside the cache could otherwise
            # redirect mkdir, the download and the rename, or serve someone else's bytes.
            self._layout.make_dir(directory)
        lock = self._locks.lock(shard, progress)
        started = time.monotonic()
        with lock.hold(done=lambda: self._hits.current_stat(shard) is not None) as held:
            waited = time.monotonic() - started
            st = self._hits.current_stat(shard)
            if st is not None:  # published by another process while we waited
                self._stats.count(url, shared=1, bytes_served=st.st_size, lock_wait_seconds=waited)
                return final
            if not held:  # published, then evicted before we looked: download unlocked
                logger.debug("fetching %s without its lock", url)
            else:  # held: a .part of this shard (or beside it) of a dead process can go
                self._space.remove_leftovers(final.parent)

            def report(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
                lock.heartbeat(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)
                if progress is not None:
                    progress(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)

            report(phase=REQUESTING, bytes_done=0, bytes_total=None)
            t0 = time.monotonic()
            peer = self.peers.fill(shard, report) if self.peers is not None else None
            if peer is not None:
                self._stats.count(
                    url,
                    from_peers=1,
                    bytes_from_peers=peer.size or 0,
                    bytes_served=peer.size or 0,
                    download_seconds=time.monotonic() - t0,
                    lock_wait_seconds=waited,
                )
                return final
            with self._remote.open(url) as opened:
                info = self._download_handling_disk_full(opened, shard, report, offers)
            metrics.collector().shard_downloaded(url, time.monotonic() - t0, info.size)
            method = verified_method(info)
            if method == SIZE_ONLY:
                published_by_size(shard, self._settings.verify)
            self._stats.count(
                url,
                verified=method,
                misses=1,
                bytes_downloaded=info.size,
                bytes_served=info.size,
                download_seconds=time.monotonic() - t0,
                lock_wait_seconds=waited,
            )
            return final

    def _download_handling_disk_full(
        self, opened: OpenedObject, shard: ShardId, report: Progress, offers: Offers | None
    ) -> ObjectInfo:
        """Download the ``opened`` object into a private temp file and publish it, verified.

        A disk that fills up meanwhile (ENOSPC/EDQUOT from the reservation, a write, the
        flush, the truncate or the fsync; possible where nothing was reserved) gets one
        eviction pass and, if that made room, one retry; then :class:`CacheFullError` with
        the numbers. Any other local failure is a :class:`CacheDirError` at once. Either
        way the temp file is removed and nothing is published. An object whose size is
        unknown ahead (a ``pipe:`` command) gets no eviction pass: there is no size to make
        room for, so a full disk is a :class:`CacheFullError` at once.
        """
        final, info = shard.data_path, opened.info
        try:
            return self._download_once(opened, shard, report, offers)
        except DiskFull as exc:
            first = exc.__cause__
            if info.size is None:
                raise self._space.full_error(
                    final,
                    replace(info, size=exc.written),
                    f"the disk filled up after {exc.written} bytes of a command's output (its "
                    "size is unknown until it ends, so no room is made ahead; with "
                    "SHARDCACHE_MAX_BYTES below the disk size eviction keeps room)",
                ) from first
        logger.warning(
            "the disk filled up while caching %s (%s): one eviction pass, then one retry",
            info.url,
            first,
        )
        try:
            with evict_lock(self._layout):
                self._space.make_room(final, info)
        except CacheFullError as full:
            raise CacheFullError(
                f"{full.message} (The download had stopped when the disk filled up: {first}; "
                "one eviction pass could not make room.)",
                **full.details,
            ) from first
        try:
            return self._download_once(opened, shard, report, offers)
        except DiskFull as exc:
            raise self._space.full_error(
                final,
                info,
                f"the disk filled up again after one eviction pass and one retry ({exc.__cause__})",
            ) from exc.__cause__

    def _download_once(
        self, opened: OpenedObject, shard: ShardId, report: Progress, offers: Offers | None
    ) -> ObjectInfo:
        info = opened.info
        with self._publisher.begin(shard, info) as part:
            # Readable as it lands, and told the outcome. Not a pipe: command's output (size
            # unknown): a run is judged only by its exit status at the end and any failed run
            # is repeated from byte 0, which would fail every reader of the first run.
            growing = None
            if offers is not None and info.size is not None:
                growing = GrowingFile(part.fd, shard.data_path, info.url, offers)

            def reported(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
                part.progressed(bytes_done)
                report(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)

            try:
                # A failure to write ``out`` comes back as the OSError itself, never retried.
                with growing.writer() if growing else part.file() as out:
                    info = self._remote.download(info, out, reported, opened)
                    out.truncate()  # a smaller object than reserved for (it changed): no tail
                    out.flush()
                part.written(info)
                report(phase="publishing", bytes_done=info.size, bytes_total=info.size)
                size = part.commit(info)
                if growing is not None:
                    growing.published(size)
            except BaseException as exc:
                tell_failed(growing, exc)
                raise
            return info
