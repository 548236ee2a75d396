"""``ShardCache``: a local copy of any fsspec URL, published atomically and verified.

The download path is a chain of small steps: hit check -> lock -> re-check -> metadata ->
space check -> download into a private temp file -> verify -> fsync -> rename -> fsync dir.

Invariant: the lock only avoids downloading a shard twice. Correctness comes from the
per-process temp file renamed into place: a reader only ever opens the final name, which
exists only once complete and verified, so no reader can see a partial shard even if a
writer is SIGKILLed at any instant (it leaves only its ``.part``, swept later).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from . import _metrics as metrics
from ._config import PREFETCH_OPTIONS, Settings, prefetch_overrides
from ._errors import CacheDirError, CacheFullError, ConfigError, FetchError, ShardCacheError
from ._eviction import (
    CacheEntry,
    EvictReport,
    evict_lock,
    evict_locked,
    evict_lru,
    remove,
    scan,
    touch,
)
from ._freshness import Freshness
from ._fsinfo import mount_for
from ._growing import Announce, GrowingFile
from ._index import Index
from ._layout import CacheLayout, ShardId, namespace
from ._lock_node import node_lock_path, node_lock_root
from ._lock_policy import LockPolicy
from ._locks import ShardLock
from ._metadata import write_meta
from ._pins import open_pinned, pin, reopen_pinned
from ._prefetch import Prefetcher
from ._redact import get_logger, redact_url
from ._remote import ObjectInfo, OpenedObject, Progress, Remote, RemoteOptions
from ._retry import RetryPolicy
from ._safefs import SafeFS
from ._throttle import process_throttle
from ._trust import Trust, describe_owner
from ._url_check import check_url
from ._url_kinds import LOCAL_PROTOCOLS, url_protocol

logger = get_logger(__name__)
_T = TypeVar("_T")

VANISHED_RETRIES = 8  # a miss is made again at most this often when its files vanish
IDENTITY_MEMO = 65_536  # URLs whose identity a cache remembers (oldest dropped first)
_VANISHED_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE})
# CacheStats counters that are also loader metrics (shardcache._metrics); lock waits are
# counted by the lock itself, which knows whom it waited for.
_METRICS_COUNTS = frozenset({"hits", "misses", "shared", "bytes_downloaded", "bytes_served"})


class _DiskFull(Exception):
    """One download attempt stopped on a full disk (the OSError is ``__cause__``) after
    writing ``written`` bytes."""

    def __init__(self, written: int) -> None:
        super().__init__(written)
        self.written = written


@dataclass
class CacheStats:
    """Counters of this process's cache activity."""

    hits: int = 0  # found complete in the cache
    misses: int = 0  # downloaded by this process
    shared: int = 0  # downloaded by another process while we waited for the lock
    bytes_downloaded: int = 0
    bytes_served: int = 0  # bytes of shards returned (hits, misses and shared)
    download_seconds: float = 0.0
    lock_wait_seconds: float = 0.0
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ShardCache:
    """A per-rank (or per-node) local cache of remote shards.

    >>> cache = ShardCache()                     # settings from SHARDCACHE_* / launcher env
    >>> path = cache.fetch("s3://bucket/train-000001.tar")
    >>> with cache.open("s3://bucket/train-000001.tar") as f: ...

    Arguments left as ``None`` come from ``SHARDCACHE_*`` variables, then the launcher
    environment (torchrun, SLURM), then defaults; see :class:`shardcache.Settings`
    for every keyword (``max_bytes``, ``lock_mode``, ``lock_timeout``, ``retries``, ...).
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        scope: str | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> None:
        explicit = {"cache_dir": cache_dir, "scope": scope, "storage_options": storage_options}
        explicit.update(overrides)
        if settings is None:
            settings = Settings.resolve(**explicit)
        elif any(v is not None for v in explicit.values()):
            settings = settings.replace(**{k: v for k, v in explicit.items() if v is not None})
        self.settings = settings
        self._init_runtime()

    def _init_runtime(self) -> None:
        s = self.settings
        self.layout = CacheLayout(s.scope_dir, Trust.for_group(s.shared_group))
        self.remote = Remote(
            RemoteOptions(
                storage_options=s.storage_options,
                retry=RetryPolicy(s.retries, s.retry_backoff, slowdown_time=s.slowdown_retry_time),
                io_timeout=s.io_timeout,
                chunk_size=s.chunk_size,
                verify=s.verify,
                parallel_threshold=s.parallel_threshold,
                part_size=s.part_size,
                max_parts_in_flight=s.parallel_parts,
                # Every prefetch thread downloading parts at once, through one client.
                max_connections=max(10, s.threads * s.parallel_parts),
                throttle=process_throttle(s.max_request_rate, s.job_request_rate, s.world_size),
            )
        )
        if s.metrics is not None:  # metrics files asked for in code or the environment
            metrics.configure(s.metrics, s.metrics_interval)
        self._freshness = Freshness(self.layout, self.remote, s.revalidate)
        self._namespaces: dict[str, str] = {}  # protocol -> its store, resolved once
        self._identities: dict[str, ShardId] = {}  # url -> its identity (IDENTITY_MEMO)
        self._identities_lock = threading.Lock()
        self._stats = CacheStats()
        self._stats_lock = threading.Lock()
        self._policy: LockPolicy | None = None
        self._node_fs: SafeFS | None = None  # lease mode: the node-local lock directory
        self._network_fs: bool | None = None
        self._index_: Index | None = None
        self._index_failed = False  # the index failed once: this process lists instead
        self._pins: dict[Path, list[int]] = {}  # prefetched shards not yet released
        self._pins_lock = threading.Lock()

    @classmethod
    def from_env(cls) -> ShardCache:
        """A cache configured only by the environment."""
        return cls()

    # Picklable (DataLoader workers): runtime state is rebuilt in the receiving process.
    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.settings = state["settings"]
        self._init_runtime()

    def __repr__(self) -> str:
        return f"ShardCache({str(self.settings.scope_dir)!r})"

    # -- queries ---------------------------------------------------------------------

    def path_for(self, url: str) -> Path:
        """Where ``url`` is (or would be) cached. Does not touch the network or the disk."""
        return self._identify(url).data_path

    def contains(self, url: str) -> bool:
        """True if a complete, current copy of ``url`` is in the cache (a local source
        unchanged since; a remote one checked within SHARDCACHE_REVALIDATE, when set)."""
        return self._current_stat(self._identify(url)) is not None

    def _identify(self, url: str) -> ShardId:
        """``url``'s identity and paths, remembered for the most recent ``IDENTITY_MEMO``
        URLs (a hit's largest cost otherwise); the fetch path passes them on."""
        shard = self._identities.get(url)
        if shard is not None:
            return shard
        check_url(url)
        protocol = url_protocol(url)
        store = self._namespaces.get(protocol)
        if store is None:
            store = namespace(protocol, self.remote.storage_options_for(protocol))
            self._namespaces[protocol] = store
        shard = self.layout.identify(url, protocol, store)
        if protocol in LOCAL_PROTOCOLS and not url.startswith(("/", "file:///")):
            return shard  # relative to the working directory (or ~): not a fixed identity
        with self._identities_lock:
            if len(self._identities) >= IDENTITY_MEMO:
                del self._identities[next(iter(self._identities))]  # the oldest remembered
            self._identities[url] = shard
        return shard

    def stats(self) -> CacheStats:
        """A snapshot of this process's counters."""
        with self._stats_lock:
            return CacheStats(**self._stats.as_dict())

    # -- fetching --------------------------------------------------------------------

    def open(self, url: str) -> BinaryIO:
        """Fetch ``url`` if needed and open the cached copy for binary reading; the shard
        cannot be evicted while the file is open.

        With SHARDCACHE_READ_WHILE_DOWNLOADING=on (the default), a shard this process
        downloads is readable as its bytes arrive: reads block for bytes not yet written and
        the end of file comes only once the download was verified and published. A failed
        verification raises :class:`IntegrityError` from a read (after bytes that failed it
        were returned); closing the file before the download ended cancels the download.
        Waits for bytes raise :class:`StallError` after SHARDCACHE_STALL_TIMEOUT without
        progress."""
        if self.settings.read_while_downloading == "off":
            _path, fd = self._fetch_and_pin(url, None)
            assert fd is not None
            return os.fdopen(fd, "rb")
        shard = self._identify(url)
        if self._hit(shard):
            fd = pin(self.layout, shard.data_path)
            if fd is not None:
                return os.fdopen(fd, "rb")
        s = self.settings
        prefetcher = Prefetcher(
            self._fetch_streaming,
            [url],
            threads=1,
            depth=1,
            stall_timeout=s.stall_timeout,
            release=self._unpin,
        )
        try:
            shard, early, until_stall = prefetcher.next_early()
        except FetchError as exc:
            prefetcher.close()
            if isinstance(exc.__cause__, ShardCacheError):  # as fetch() raises it
                raise exc.__cause__ from None
            raise
        except BaseException:
            prefetcher.close()
            raise
        if early is not None:
            assert isinstance(early, GrowingFile)
            return early.open(until_stall, on_close=prefetcher.close)
        try:
            return self.open_prefetched(shard.path)  # its own pin: the prefetcher's can go
        finally:
            prefetcher.close()

    def open_prefetched(self, path: Path) -> BinaryIO:
        """Open a shard that :meth:`prefetch` handed over and has not released yet. It is read
        through the prefetcher's pin, so it opens even if its file was removed meanwhile
        (a tmp cleaner); pinned (not evictable) until closed."""
        with self._pins_lock:
            fds = self._pins.get(Path(path))
            pin_fd = fds[-1] if fds else None
        if pin_fd is None:
            return open_pinned(self.layout, Path(path))
        return reopen_pinned(pin_fd)

    def fetch(self, url: str, progress: Progress | None = None) -> Path:
        """Return the path of a complete, verified local copy of ``url``, downloading it
        at most once across all processes sharing this cache directory."""
        return self._fetch(url, progress, None)

    def _fetch(self, url: str, progress: Progress | None, announce: Announce | None) -> Path:
        """``fetch``; ``announce`` (if given) gets the :class:`GrowingFile` of a download
        this process makes, once its first bytes landed."""
        shard = self._identify(url)
        if self._hit(shard):
            return shard.data_path
        try:
            return self._fetch_missing(shard, progress, announce)
        except Exception:  # a cancelled prefetch (a BaseException) is not an error
            self._count(shard.url, errors=1)
            raise

    def _hit(self, shard: ShardId) -> bool:
        """Whether ``shard`` is cached and current (then counted as a hit)."""
        st = self._servable_stat(shard.data_path)
        if st is not None and self._freshness.is_current(shard, st, ask_store=True):
            touch(self.layout, shard.data_path, st.st_mtime)
            self._count(shard.url, hits=1, bytes_served=st.st_size)
            return True
        return False

    def _fetch_missing(
        self, shard: ShardId, progress: Progress | None, announce: Announce | None
    ) -> Path:
        """The miss path, made again when the cache's own directories or files vanish
        under it (tmp cleaners, a user's ``rm -rf``): every step recreates what it needs."""
        offers = _Offers(announce) if announce is not None else None
        try:
            return self._fetch_missing_again(shard, progress, offers)
        except BaseException as exc:
            if offers is not None:
                offers.failed(exc)
            raise

    def _fetch_missing_again(
        self, shard: ShardId, progress: Progress | None, offers: _Offers | None
    ) -> Path:
        attempt = 0
        while True:
            attempt += 1
            try:
                path = self._fetch_miss(shard, progress, offers)
                if offers is None or offers.resumed(self.layout, path):
                    return path
                raise _Vanished(path)  # gone again before its reader could go on in it
            except _Vanished as exc:
                if attempt == VANISHED_RETRIES:
                    raise CacheDirError(
                        f"cannot cache {shard.url}: the cache's files kept disappearing while it "
                        f"was being fetched ({attempt} attempts; last: {exc.path} vanished). "
                        f"Something is deleting {self.settings.scope_dir} (a tmp cleaner such "
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

    def _fetch_and_pin(
        self, url: str, progress: Progress | None, announce: Announce | None = None
    ) -> tuple[Path, int | None]:
        """``fetch``, then a pin (shared flock) on the result; fetched again if the file
        went (evicted, or removed) between the two. With ``announce``: a download this
        process made is pinned since its ``.part`` was created (no gap at all), and a
        download a reader claimed early is pinned by that reader (the pin is then None)."""
        offered: list[GrowingFile] = []

        def offer(growing: GrowingFile) -> None:
            offered.append(growing)
            if announce is not None:
                announce(growing)

        for _ in range(VANISHED_RETRIES):
            offered.clear()
            if announce is None:
                path = self.fetch(url, progress)
            else:
                path = self._fetch(url, progress, offer)
            fd = offered[-1].detach_pin() if offered else None
            if any(growing.claimed for growing in offered):
                if fd is not None:
                    os.close(fd)
                return path, None
            if fd is None:
                fd = pin(self.layout, path)
            if fd is not None:
                return path, fd
        raise CacheFullError(
            f"{url} was evicted or removed {VANISHED_RETRIES} times right after being fetched. "
            f"Either SHARDCACHE_MAX_BYTES={self.settings.max_bytes} cannot hold the shards in "
            "use plus the prefetch depth (raise it, or lower SHARDCACHE_PREFETCH_DEPTH), or "
            f"something keeps deleting files in {self.settings.scope_dir}.",
            url=url,
            path=str(path),
            max_bytes=self.settings.max_bytes,
        )

    def _fetch_miss(
        self, shard: ShardId, progress: Progress | None, announce: Announce | None
    ) -> Path:
        url, final = shard.url, shard.data_path
        for directory in (final.parent, shard.lock_path.parent):
            # On every miss, made again if removed (a tmp cleaner), checked before and after
            # mkdir: a link or a foreign directory planted inside the cache could otherwise
            # redirect mkdir, the download and the rename, or serve someone else's bytes.
            self.layout.make_dir(directory)

        def holder_progress(record: dict[str, Any] | None) -> None:
            if progress is not None and record is not None:
                progress(
                    phase=f"waiting for pid {record.get('pid')} on {record.get('host')}",
                    bytes_done=int(record.get("bytes_done") or 0),
                    bytes_total=record.get("bytes_total"),
                )

        policy = self._lock_policy()
        node_fs = self._node_lock_fs() if policy.mode == "lease" else None
        lock = ShardLock(
            shard.lock_path,
            url=url,
            policy=policy,
            rank=self.settings.rank,
            on_wait=holder_progress,
            fs=self.layout.fs,
            node_lock=None if node_fs is None else node_lock_path(node_fs.root, shard.lock_path),
            node_fs=node_fs,
        )
        started = time.monotonic()
        with lock.hold(done=lambda: self._current_stat(shard) is not None) as held:
            waited = time.monotonic() - started
            st = self._current_stat(shard)
            if st is not None:  # published by another process while we waited
                self._count(url, shared=1, bytes_served=st.st_size, lock_wait_seconds=waited)
                return final
            if not held:  # published, then evicted before we looked: download unlocked
                logger.debug("fetching %s without its lock", url)

            def report(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
                lock.heartbeat(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)
                if progress is not None:
                    progress(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)

            report(phase="requesting", bytes_done=0, bytes_total=None)
            t0 = time.monotonic()
            with self.remote.open(url) as opened:
                info = self._download_and_publish(opened, shard, report, announce)
            metrics.collector().shard_downloaded(url, time.monotonic() - t0, info.size)
            self._count(
                url,
                misses=1,
                bytes_downloaded=info.size,
                bytes_served=info.size,
                download_seconds=time.monotonic() - t0,
                lock_wait_seconds=waited,
            )
            return final

    def _download_and_publish(
        self, opened: OpenedObject, shard: ShardId, report: Progress, announce: Announce | None
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
            return self._publish_once(opened, shard, report, announce)
        except _DiskFull as exc:
            first = exc.__cause__
            if info.size is None:
                raise self._full_error(
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
            with evict_lock(self.layout):
                self._make_room(final, info)
        except CacheFullError as full:
            raise CacheFullError(
                f"{full.message} (The download had stopped when the disk filled up: {first}; "
                "one eviction pass could not make room.)",
                **full.details,
            ) from first
        try:
            return self._publish_once(opened, shard, report, announce)
        except _DiskFull as exc:
            raise self._full_error(
                final,
                info,
                f"the disk filled up again after one eviction pass and one retry ({exc.__cause__})",
            ) from exc.__cause__

    def _publish_once(
        self, opened: OpenedObject, shard: ShardId, report: Progress, announce: Announce | None
    ) -> ObjectInfo:
        final, info = shard.data_path, opened.info
        part = self.layout.temp_path(final)
        fd: int | None = None
        growing: GrowingFile | None = None
        sized_ahead = info.size is not None
        try:
            fd = self._create_reserved_part(part, final, info)
            # Readable as it lands, and told the outcome. Not a pipe: command's output (size
            # unknown): a run is judged only by its exit status at the end and any failed run
            # is repeated from byte 0, which would fail every reader of the first run.
            if announce is not None and sized_ahead:
                growing = GrowingFile(fd, final, info.url, announce)
            # The descriptor outlives the file object: publishing may need the bytes again.
            # A failure to write ``out`` comes back as the OSError itself, never retried.
            with growing.writer() if growing else os.fdopen(fd, "wb", closefd=False) as out:
                info = self.remote.download(info, out, report, opened)
                out.truncate()  # a smaller object than reserved for (it changed): no tail
                out.flush()
            os.fsync(fd)
            if not sized_ahead and self.settings.max_bytes is not None:
                with evict_lock(self.layout):  # now that the size is known: within the limit
                    self._make_room(final, info, on_disk=True)
            report(phase="publishing", bytes_done=info.size, bytes_total=info.size)
            url = shard.canonical_url
            write_meta(
                self.layout,
                final,
                {
                    # Never a credential on disk: a presigned URL's signature or a password
                    # in it is recorded as ***, flagged so that verify knows it cannot reuse it.
                    "url": redact_url(url),
                    "url_redacted": redact_url(url) != url,
                    "namespace": redact_url(shard.namespace),
                    "size": info.size,
                    "etag": info.etag,
                    "md5": info.md5,
                    # The store's own checksum, and what this copy was checked against
                    # beyond its size ("crc64nvme", ..., "md5"; "size" for nothing more).
                    "checksum": info.checksum.as_record() if info.checksum else None,
                    "verified": info.verified.algorithm if info.verified else "size",
                    "version_id": info.version_id,
                    "mtime_ns": info.mtime_ns,
                    "data_ino": os.fstat(fd).st_ino,  # the copy this record describes
                    "fetched_at": time.time(),
                },
            )
            self._publish(fd, part, final)
            if growing is not None:
                growing.published(os.fstat(fd).st_size)
            return info
        except ShardCacheError as exc:
            _unlink_quietly(self.layout.fs, part)
            _tell_failed(growing, exc)
            raise
        except OSError as exc:  # local I/O: remote errors arrive as FetchError
            _unlink_quietly(self.layout.fs, part)
            _tell_failed(growing, exc)
            if exc.errno in _VANISHED_ERRNOS:  # our directory (and the .part in it) was removed
                raise _Vanished(Path(exc.filename or part)) from exc
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _DiskFull(_written(fd)) from exc
            raise CacheDirError(
                f"cannot write {part} while caching {info.url}: {exc}. Check that "
                f"{self.settings.scope_dir} is a writable directory on a healthy file system "
                "(SHARDCACHE_DIR); nothing was published.",
                path=str(part),
                url=info.url,
                errno=exc.errno,
            ) from exc
        except BaseException as exc:
            _unlink_quietly(self.layout.fs, part)
            _tell_failed(growing, exc)
            raise
        finally:
            if fd is not None:
                os.close(fd)

    def _create_reserved_part(self, part: Path, final: Path, info: ObjectInfo) -> int:
        """Make room for ``info`` (evicting), create ``part`` and reserve its size, all under
        the scope's eviction lock: the next process's count includes this download, so
        published + reserved in-flight bytes never exceed SHARDCACHE_MAX_BYTES. A size not
        known ahead (``pipe:``) reserves nothing: the room is made once the download ended
        (:meth:`_publish_once`), and meanwhile the evictor counts the ``.part`` as it grows."""
        if info.size is None:
            if self._index() is None:
                return self._create_part(part)
            with evict_lock(self.layout):
                self._index_call(lambda index: index.add_part(part, final))
                return self._create_part(part)
        with evict_lock(self.layout):
            self._make_room(final, info)
            # Registered before the file exists: no part is ever uncounted.
            self._index_call(lambda index: index.add_part(part, final))
            fd = self._create_part(part)
            try:
                self._reserve(fd, info)
            except BaseException:
                os.close(fd)
                raise
            return fd

    def _create_part(self, part: Path) -> int:
        """Create the download file ``part``, making its directory again if it vanished."""
        for _ in range(VANISHED_RETRIES):
            try:
                # O_RDWR: a parallel download hashes the file back from disk to verify it.
                fd = self.layout.fs.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileNotFoundError:
                self.layout.make_dir(part.parent)
                continue
            try:
                self.layout.trust.adopt_file(fd, self.layout.trust.file_mode)
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise _Vanished(part.parent)

    def _publish(self, fd: int, part: Path, final: Path) -> None:
        """Rename the verified download ``part`` (open as ``fd``) to ``final`` durably.

        If the directory was removed meanwhile (a tmp cleaner), the verified bytes are
        still ours through ``fd``: copy them into a new temp file in the recreated
        directory and publish that, instead of downloading again.

        With SHARDCACHE_MAX_BYTES this runs under the eviction lock: a rename while an
        evictor lists the directory could hide the file under both names (readdir need
        not return an entry renamed during the listing) and the count would fall short."""
        bounded = self.settings.max_bytes is not None
        with evict_lock(self.layout) if bounded else contextlib.nullcontext():
            self._publish_locked(fd, part, final)
            self._index_call(lambda index: index.published(part, final))

    def _publish_locked(self, fd: int, part: Path, final: Path) -> None:
        original = part
        try:
            for _ in range(VANISHED_RETRIES):
                try:
                    self.layout.fs.replace(part, final)
                    self.layout.fs.fsync_dir(final.parent)
                    return
                except FileNotFoundError:
                    if os.fstat(fd).st_nlink:
                        raise  # not our directory's removal: let the caller judge
                logger.info("%s was removed before it was published; publishing a copy", part)
                self.layout.make_dir(final.parent)
                part = self.layout.temp_path(final)
                _copy_file(fd, part, self.layout.fs)
            raise _Vanished(final.parent)
        except BaseException:
            if part != original:
                _unlink_quietly(self.layout.fs, part)
            raise

    def _reserve(self, fd: int, info: ObjectInfo) -> None:
        """Reserve the download's full size (SHARDCACHE_PREALLOCATE=auto, local disks): a full
        disk then fails before any byte is fetched, and the evictor counts this download at
        its full size. Not on network file systems, where glibc would emulate it by writing
        zeros; a file system that cannot reserve (EOPNOTSUPP, EINVAL) downloads unreserved."""
        if not info.size:
            return
        # The apparent size is what the evictor counts (a sparse file takes no blocks).
        os.ftruncate(fd, info.size)
        if self.settings.preallocate == "off" or self._on_network_fs():
            return
        try:
            os.posix_fallocate(fd, 0, info.size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            logger.debug("cannot reserve space for %s (%s); downloading unreserved", info.url, exc)

    def prefetch(
        self,
        urls: Iterable[str],
        threads: int | None = None,
        depth: int | None = None,
        stall_timeout: float | None = None,
    ) -> Prefetcher:
        """Fetch ``urls`` ahead of the consumer; iterate the result for ``(url, path)`` in
        input order. Defaults: ``SHARDCACHE_THREADS``, ``SHARDCACHE_PREFETCH_DEPTH``,
        ``SHARDCACHE_STALL_TIMEOUT`` (see :class:`shardcache.Prefetcher`)."""
        given = prefetch_overrides(threads=threads, depth=depth, stall_timeout=stall_timeout)
        defaults = {
            option: getattr(self.settings, name) for option, name in PREFETCH_OPTIONS.items()
        }
        return Prefetcher(self._fetch_pinned, urls, **(defaults | given), release=self._unpin)

    def _fetch_pinned(self, url: str, progress: Progress) -> Path:
        """``fetch`` for the prefetcher: the shard stays pinned (not evictable) until the
        prefetcher releases it, after its consumer is done with it."""
        path, fd = self._fetch_and_pin(url, progress)
        assert fd is not None
        self._hold_pin(path, fd)
        return path

    def _fetch_streaming(self, url: str, progress: Progress) -> Path:
        """``_fetch_pinned`` whose download is offered to the consumer as soon as its first
        bytes landed (``progress.offer``: :meth:`Prefetcher.next_early`). A shard the
        consumer claimed early is pinned by its reader, not held for the prefetcher."""
        offer = getattr(progress, "offer", None)
        path, fd = self._fetch_and_pin(url, progress, offer)
        if fd is not None:
            self._hold_pin(path, fd)
        return path

    def prefetch_streaming(self, urls: Iterable[str], **options: Any) -> Prefetcher:
        """:meth:`prefetch` for :meth:`Prefetcher.next_early`: shards this process downloads
        can be read while they download (SHARDCACHE_READ_WHILE_DOWNLOADING)."""
        given = prefetch_overrides(**options)
        defaults = {
            option: getattr(self.settings, name) for option, name in PREFETCH_OPTIONS.items()
        }
        early = self.settings.read_while_downloading == "on"
        fetch = self._fetch_streaming if early else self._fetch_pinned
        return Prefetcher(fetch, urls, **(defaults | given), release=self._unpin)

    def _hold_pin(self, path: Path, fd: int) -> None:
        with self._pins_lock:
            self._pins.setdefault(path, []).append(fd)

    def _unpin(self, path: Path) -> None:
        with self._pins_lock:
            fds = self._pins.get(path)
            fd = fds.pop() if fds else None
            if fds == []:
                del self._pins[path]
        if fd is not None:
            os.close(fd)

    # -- helpers ---------------------------------------------------------------------

    def _servable_stat(self, final: Path) -> os.stat_result | None:
        """``final``'s lstat if it is a regular file this cache trusts (:class:`Trust`): a
        file another user could have written is never served (the miss path replaces it)."""
        try:
            st = self.layout.fs.lstat(final)
        except OSError:  # missing, or an untrusted directory on the way (the miss path says)
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        if not self.layout.trust.trusts_file(st):
            logger.warning(
                "not serving %s: it is %s, which this cache does not trust; fetching it again",
                final,
                describe_owner(st),
            )
            return None
        return st

    def _current_stat(self, shard: ShardId) -> os.stat_result | None:
        """The published copy's lstat if it may be served without asking the store."""
        st = self._servable_stat(shard.data_path)
        if st is None or not self._freshness.is_current(shard, st, ask_store=False):
            return None
        return st

    def _make_room(self, final: Path, info: ObjectInfo, *, on_disk: bool = False) -> None:
        """Evict least-recently-used shards so ``info`` fits within SHARDCACHE_MAX_BYTES
        and on the disk; CacheFullError (with the numbers) when it cannot. The caller
        holds :func:`evict_lock`. ``on_disk``: the bytes are already downloaded into a
        ``.part``, which the evictor's count includes (and the disk already holds)."""
        max_bytes = self.settings.max_bytes
        size = info.size or 0
        if max_bytes is not None:
            if size > max_bytes:
                raise self._full_error(
                    final, info, f"the shard alone exceeds SHARDCACHE_MAX_BYTES={max_bytes}"
                )
            reserve = 0 if on_disk else size
            report = self._evict_locked(max_bytes, reserve)
            if report.kept_bytes + reserve > max_bytes:
                raise self._full_error(
                    final,
                    info,
                    f"the cache holds {report.kept_bytes} of SHARDCACHE_MAX_BYTES={max_bytes} "
                    f"bytes and nothing more is evictable ({report.in_use} shards, "
                    f"{report.in_use_bytes} bytes, are in use by live processes; the rest is "
                    "downloads in progress)",
                    report,
                )
        free = _free_bytes(final.parent)
        if on_disk or free >= size:
            return
        used = self._used_bytes()
        report = self._evict_locked(max(0, used - (size - free)), 0)
        free = _free_bytes(final.parent)
        if free < size:
            raise self._full_error(
                final,
                info,
                f"only {free} bytes are free on the disk after evicting {report.freed_bytes} "
                f"bytes ({report.in_use} shards, {report.in_use_bytes} bytes, are in use and "
                "could not be evicted)",
                report,
            )

    def _full_error(
        self, final: Path, info: ObjectInfo, seen: str, report: EvictReport | None = None
    ) -> CacheFullError:
        free = _free_bytes(final.parent)
        return CacheFullError(
            f"no room to cache {info.url} ({info.size} bytes needed) in {final.parent}: "
            f"{seen}. Free disk space, set SHARDCACHE_MAX_BYTES below the disk size, or point "
            "SHARDCACHE_DIR at a larger node-local disk. Nothing partial was left behind.",
            url=info.url,
            path=str(final.parent),
            needed=info.size,
            free=free,
            max_bytes=self.settings.max_bytes,
            evictable=0 if report else None,  # with a report, every evictable shard is gone
            in_use=report.in_use if report else 0,
            in_use_bytes=report.in_use_bytes if report else 0,
        )

    # -- maintenance -----------------------------------------------------------------

    def entries(self) -> list[CacheEntry]:
        """Published shards of this scope, least recently used first, with their URLs."""
        return scan(self.layout, with_meta=True)[0]

    def evict(self, max_bytes: int | None = None) -> EvictReport:
        """Evict least-recently-used shards (never one in use) down to ``max_bytes``
        (default SHARDCACHE_MAX_BYTES)."""
        limit = self.settings.max_bytes if max_bytes is None else max_bytes
        if limit is None:
            raise ConfigError(
                "evict needs a size: pass max_bytes or set SHARDCACHE_MAX_BYTES (e.g. 500G).",
                name="max_bytes",
                value=None,
            )
        if self._on_network_fs():
            return evict_lru(self.layout, limit)
        index = self._index(always=True)
        assert index is not None
        with evict_lock(self.layout):
            # Asked for explicitly (the CLI): exact, even if processes without max_bytes
            # (which do not keep the index) published meanwhile.
            index.rebuild()
            return index.evict(limit)

    def remove(self, path: Path) -> bool:
        """Remove a published shard and its metadata; False if missing or in use. Also
        from the scope's index when there is one (``verify`` runs without max_bytes)."""
        index = self._index(always=self.layout.fs_exists(self.layout.index_path))
        if index is None:
            return remove(self.layout, Path(path))
        with evict_lock(self.layout):
            removed = remove(self.layout, Path(path))
            if removed:
                index.forget(Path(path))
            return removed

    # -- accounting (the index, or a listing of the directory) ---------------------------

    def _index(self, *, always: bool = False) -> Index | None:
        """The scope's index when this process keeps it: SHARDCACHE_MAX_BYTES set (or
        ``always``: an explicit evict) and a local disk (see :mod:`shardcache._index`)."""
        if (self.settings.max_bytes is None and not always) or self._on_network_fs():
            return None
        if self._index_failed:
            return None
        if self._index_ is None:
            self._index_ = Index(self.layout)
        return self._index_

    def _index_call(
        self, op: Callable[[Index], _T], fallback: Callable[[], _T] | None = None
    ) -> Any:
        """``op`` on the index when this process keeps one, else ``fallback``. The index is
        an optimisation: if it fails (its directory removed under us by a tmp cleaner, a
        lock held beyond its timeout), this process lists the directory from then on, as
        before the index, and says so once; a damaged file is rebuilt, not a failure."""
        index = self._index()
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
            lambda: evict_locked(self.layout, max_bytes, reserve=reserve),
        )

    def _used_bytes(self) -> int:
        """Published bytes plus downloads in progress (the caller holds evict_lock)."""

        def listed() -> int:
            entries, partial = scan(self.layout)
            return partial + sum(e.size for e in entries)

        return self._index_call(lambda index: index.used_bytes(), listed)

    def _on_network_fs(self) -> bool:
        if self._network_fs is None:
            self._network_fs = mount_for(self.settings.scope_dir).is_network
        return self._network_fs

    def _lock_policy(self) -> LockPolicy:
        if self._policy is None:
            s = self.settings
            mode = s.lock_mode
            mount = mount_for(s.scope_dir)
            if mount.is_network:
                logger.warning(
                    "shardcache directory %s is on a network file system (%s): a node-local "
                    "disk is much faster; set SHARDCACHE_DIR to one",
                    s.scope_dir,
                    mount.describe(),
                )
            if mode == "auto":
                mode = "lease" if mount.is_network else "flock"
            self._policy = LockPolicy(
                mode=mode,
                timeout=s.lock_timeout,
                stuck_after=s.lock_stuck_after,
                lease_time=s.lease_time,
            )
        return self._policy

    def _node_lock_fs(self) -> SafeFS | None:
        """Lease mode: the node-local directory of the node locks (None if turned off).
        Private to the user whatever the cache's group: it is this node's alone."""
        if self._node_fs is None:
            root = node_lock_root(self.settings.node_lock_dir, self.settings.scope_dir)
            if root is None:
                return None
            self._node_fs = SafeFS(root, Trust.private())
        return self._node_fs

    def _count(self, url: str, **deltas: float) -> None:
        """Add ``deltas`` (about shard ``url``) to the cache's stats and the metrics."""
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)
        shown = {k: v for k, v in deltas.items() if k in _METRICS_COUNTS}
        if shown:
            metrics.count(url, **shown)


def _tell_failed(growing: GrowingFile | None, exc: BaseException) -> None:
    """Tell a download's early reader (if any) that this attempt failed with ``exc``."""
    if growing is not None:
        growing.stopped(exc)


class _Offers:
    """The early-readable downloads of one fetch: the first is offered to ``announce``; a
    later attempt of the same fetch (after a vanished directory, a full disk) is offered to
    no one, and a reader of a stopped first attempt goes on in the published shard."""

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


class _NotOffered(Exception):
    """Why a later attempt's download cannot be claimed: its fetch offered an earlier one."""


class _Vanished(Exception):
    """A directory or file of the cache vanished mid-fetch (``path``): fetch again."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path``, or of its nearest existing ancestor."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except FileNotFoundError:
            continue
    return 0


def _copy_file(src_fd: int, dest: Path, fs: SafeFS) -> None:
    """Copy all of ``src_fd`` into the new file ``dest`` (in the kernel), durably."""
    size = os.fstat(src_fd).st_size
    out = fs.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fs.trust.adopt_file(out, fs.trust.file_mode)
        offset = 0
        while offset < size:
            sent = os.sendfile(out, src_fd, offset, size - offset)
            if sent == 0:
                raise OSError(errno.EIO, f"short copy into {dest}", str(dest))
            offset += sent
        os.fsync(out)
    except BaseException:
        os.close(out)
        _unlink_quietly(fs, dest)
        raise
    os.close(out)


def _written(fd: int | None) -> int:
    """Bytes in the (possibly unlinked) download file ``fd``; 0 when unknown."""
    if fd is None:
        return 0
    try:
        return os.fstat(fd).st_size
    except OSError:
        return 0


def _unlink_quietly(fs: SafeFS, path: Path) -> None:
    """Remove a temp file; one that cannot be removed (a read-only file system) is left for
    ``shardcache clean`` with a warning, never raised over the error being reported."""
    try:
        fs.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s (%s); `shardcache clean` removes it later", path, exc)
