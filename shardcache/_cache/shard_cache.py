"""``ShardCache``: a local copy of any fsspec URL, published atomically and verified.

A thin facade over the steps of a fetch, each a unit of its own:

    identify (:mod:`~shardcache._store.shard_ids`) -> hit? (:mod:`~shardcache._store.hits`)
      -> miss (:mod:`~shardcache._cache.miss`): lock (:mod:`~shardcache._cache.locks`) -> re-check
         -> a peer's copy (:mod:`~shardcache._cache.peer_fill`, with peers) or a download
         -> room (:mod:`~shardcache._store.space`) -> into a private temp file -> verify
         -> publish (:mod:`~shardcache._store.publish`)
      -> pin (:mod:`~shardcache._cache.pinned`)

with the early-read offers in :mod:`~shardcache._cache.offers` and the counters in
:mod:`~shardcache._cache.stats`. Correctness rests on the atomic publish, not on the lock
(the invariant is stated in :mod:`~shardcache._store.publish`).

The units work through a :class:`Wiring`: the remote store, the mount table, the disk's
free space and the metadata writer, the real ones unless a test gave others.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .._base.dirs import dir_error
from .._base.errors import CacheDirError, FetchError, ShardCacheError
from .._base.fsinfo import Mount, mount_for
from .._base.trust import Trust
from .._config.settings import PREFETCH_OPTIONS, Settings, prefetch_overrides
from .._disk.layout import CacheLayout, ShardId
from .._disk.metadata import write_meta
from .._mesh.holders import PeerSource
from .._mesh.node import MeshNode, join
from .._observe import metrics
from .._prefetch.prefetcher import Fetch, Prefetcher
from .._prefetch.workers import WorkerProgress
from .._retry.policy import RetryPolicy
from .._retry.throttle import process_throttle
from .._store.eviction import CacheEntry, EvictReport
from .._store.freshness import Freshness
from .._store.growing import Announce, GrowingFile
from .._store.hits import Hits
from .._store.pins import pin
from .._store.publish import VANISHED_RETRIES, Publisher, WriteMeta
from .._store.shard_ids import ShardIds
from .._store.space import Space
from .._transfer.remote import Progress, Remote, RemoteOptions
from .locks import CacheLocks
from .miss import MissPath
from .peer_fill import PeerFill
from .pinned import PinnedFetch, PinTable
from .stats import CacheStats, StatsCounter


@dataclass(frozen=True)
class Wiring:
    """What a cache's units work through besides its settings: the outside world (the
    remote store, the mount table, the disk's free space) and the metadata writer. The
    real ones by default; a test puts a fake in here (:meth:`ShardCache._wired`), as httpx
    takes ``transport=``. Never configuration: settings come from :class:`Settings`."""

    remote: Callable[[RemoteOptions], Remote] = Remote  # makes the remote from its options
    mount_for: Callable[[Path], Mount] = mount_for  # the file system a path is on
    disk_usage: Callable[[Path], Any] = shutil.disk_usage  # its free bytes (``.free``)
    write_meta: WriteMeta = write_meta  # a published shard's metadata record


class ShardCache:
    """A per-rank (or per-node) local cache of remote shards.

    >>> cache = ShardCache()                     # settings from SHARDCACHE_* / launcher env
    >>> path = cache.fetch("s3://bucket/train-000001.tar")
    >>> with cache.open("s3://bucket/train-000001.tar") as f: ...

    Arguments left as ``None`` come from ``SHARDCACHE_*`` variables, then the launcher
    environment (torchrun, SLURM), then defaults; see :class:`shardcache.Settings`
    for every keyword (``max_bytes``, ``lock_mode``, ``lock_timeout``, ``retries``, ...).
    """

    mesh: MeshNode | None = None  # the job's cache mesh, when on (SHARDCACHE_MESH)

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
        self._peer_source: PeerSource | None = None  # the cache mesh's holders (_attach_peers)
        self._init_runtime(Wiring())
        self.mesh = join(settings)  # SHARDCACHE_MESH: once a process (never in an unpickled copy)

    @classmethod
    def _wired(cls, settings: Settings, wiring: Wiring) -> ShardCache:
        """A cache of ``settings`` whose units work through ``wiring`` instead of the real
        collaborators (the tests' seam)."""
        cache = cls.__new__(cls)
        cache.settings = settings
        cache._peer_source = None
        cache._init_runtime(wiring)
        return cache

    def _init_runtime(self, wiring: Wiring) -> None:
        s = self.settings
        self._wiring = wiring
        self.layout = CacheLayout(s.scope_dir, Trust.for_group(s.shared_group))
        self.remote = wiring.remote(
            RemoteOptions(
                storage_options=s.storage_options,
                retry=RetryPolicy(s.retries, s.retry_backoff, slowdown_time=s.slowdown_retry_time),
                io_timeout=s.io_timeout,
                chunk_size=s.chunk_size,
                verify=s.verify,
                etag_md5=s.etag_md5,
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
        self._ids = ShardIds(self.layout, self.remote.storage_options_for)
        self._hits = Hits(self.layout, Freshness(self.layout, self.remote, s.revalidate))
        self._stats = StatsCounter()
        self._locks = CacheLocks(self.layout, s, mount_for=wiring.mount_for)
        self._space = Space(
            self.layout, s, mount_for=wiring.mount_for, disk_usage=wiring.disk_usage
        )
        self._publisher = publisher = Publisher(
            self.layout, self._space, s, write_meta=wiring.write_meta
        )
        peers = self._peer_source
        self._miss = MissPath(
            s,
            self.layout,
            self.remote,
            hits=self._hits,
            locks=self._locks,
            space=self._space,
            publisher=publisher,
            stats=self._stats,
            peers=None if peers is None else PeerFill(peers, publisher, self._stats),
        )
        self._pins = PinTable(self.layout)
        self._pinned = PinnedFetch(self.layout, s, self._pins)

    def _attach_peers(self, source: PeerSource) -> None:
        """Ask the peers ``source`` names on a miss, before the store (internal: a dataset
        gives the holders of its hand-out, :mod:`shardcache._datasets.mesh_wiring`); it
        pickles with the cache into DataLoader workers."""
        self._peer_source = source
        self._miss.peers = PeerFill(source, self._publisher, self._stats)

    def _offer(self, urls: Iterable[str]) -> None:
        """Let the job's other nodes fetch the published copies of ``urls`` from this
        node's mesh server (internal: a dataset offers its shards); nothing when the mesh
        is off."""
        if self.mesh is not None:
            shards = [self._identify(url) for url in urls]
            self.mesh.offered.add((shard.canonical_url, shard.namespace) for shard in shards)

    @classmethod
    def from_env(cls) -> ShardCache:
        """A cache configured only by the environment."""
        return cls()

    # Picklable (DataLoader workers): runtime state is rebuilt in the receiving process,
    # through the same wiring (pickled only when it is not the real one).
    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = {"settings": self.settings}
        if self._wiring != Wiring():
            state["wiring"] = self._wiring
        if self._peer_source is not None:
            state["peers"] = self._peer_source
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.settings = state["settings"]
        self._peer_source = state.get("peers")
        self._init_runtime(state.get("wiring", Wiring()))

    def __repr__(self) -> str:
        return f"ShardCache({str(self.settings.scope_dir)!r})"

    # -- queries ---------------------------------------------------------------------

    def path_for(self, url: str) -> Path:
        """Where ``url`` is (or would be) cached. Does not touch the network or the disk."""
        return self._identify(url).data_path

    def contains(self, url: str) -> bool:
        """True if a complete, current copy of ``url`` is in the cache (a local source
        unchanged since; a remote one checked within SHARDCACHE_REVALIDATE, when set)."""
        return self._hits.current_stat(self._identify(url)) is not None

    def _identify(self, url: str) -> ShardId:
        """``url``'s identity and paths (remembered: :mod:`shardcache._store.shard_ids`)."""
        return self._ids.identify(url)

    def stats(self) -> CacheStats:
        """A snapshot of this process's counters."""
        return self._stats.snapshot()

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
            _path, fd = self._pinned.fetch_and_pin(self._fetch, url, None)
            assert fd is not None
            return os.fdopen(fd, "rb")
        shard = self._identify(url)
        if self._hit(shard):
            fd = pin(self.layout, shard.data_path)
            if fd is not None:
                return os.fdopen(fd, "rb")
        prefetcher = Prefetcher(
            self._fetch_streaming,
            [url],
            threads=1,
            depth=1,
            stall_timeout=self.settings.stall_timeout,
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
        return self._pins.open(Path(path))

    def fetch(self, url: str, progress: Progress | None = None, *, count_hit: bool = True) -> Path:
        """Return the path of a complete, verified local copy of ``url``, downloading it
        at most once across all processes sharing this cache directory.

        ``count_hit=False`` for a read that delivers no data to training (indexing a
        shard's samples, checking it): a copy already cached is then not counted as a
        hit in :meth:`stats` and the loader metrics; a download still counts as a miss."""
        return self._fetch(url, progress, None, count_hit=count_hit)

    def _fetch(
        self,
        url: str,
        progress: Progress | None,
        announce: Announce | None,
        *,
        count_hit: bool = True,
    ) -> Path:
        """``fetch``; ``announce`` (if given) gets the :class:`GrowingFile` of a download
        this process makes, once its first bytes landed. ``count_hit=False``: a cached copy
        is no delivery to the loader (reading a shard's sample layout), so it is not counted
        as a hit; a download still counts as a miss (or shared)."""
        shard = self._identify(url)
        cached = self._hit(shard) if count_hit else (self._hits.hit(shard) is not None)
        if cached:
            return shard.data_path
        try:
            return self._miss.fetch(shard, progress, announce)
        except Exception:  # a cancelled prefetch (a BaseException) is not an error
            self._stats.count(shard.url, errors=1)
            raise

    def _hit(self, shard: ShardId) -> bool:
        """Whether ``shard`` is cached and current (then counted as a hit)."""
        st = self._hits.hit(shard)
        if st is None:
            return False
        self._stats.count(shard.url, hits=1, bytes_served=st.st_size)
        return True

    def _fetch_pinned(self, url: str, progress: Progress) -> Path:
        """``fetch`` for the prefetcher: the shard stays pinned (not evictable) until the
        prefetcher releases it, after its consumer is done with it."""
        return self._pinned.fetch_pinned(self._fetch, url, progress)

    def _fetch_streaming(self, url: str, progress: WorkerProgress) -> Path:
        """``_fetch_pinned`` whose download may be read as it lands (``progress.offer``)."""
        return self._pinned.fetch_streaming(self._fetch, url, progress)

    def _unpin(self, path: Path) -> None:
        """The prefetcher's release of a shard (a method of the cache: a prefetcher pickles
        with it into DataLoader workers)."""
        self._pins.release(path)

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
        return self._prefetcher(self._fetch_pinned, urls, given)

    def prefetch_streaming(self, urls: Iterable[str], **options: Any) -> Prefetcher:
        """:meth:`prefetch` for :meth:`Prefetcher.next_early`: shards this process downloads
        can be read while they download (SHARDCACHE_READ_WHILE_DOWNLOADING)."""
        early = self.settings.read_while_downloading == "on"
        fetch = self._fetch_streaming if early else self._fetch_pinned
        return self._prefetcher(fetch, urls, prefetch_overrides(**options))

    def check_dir(self) -> None:
        """Make the cache directory and write a file in it: raises
        :class:`~shardcache.CacheDirError` (what is in the way, what to do) when it is not
        a directory, cannot be made, is read-only or full. Every prefetch starts with it,
        so such a problem is reported once, before any download."""
        root = self.layout.root
        for attempt in range(1, VANISHED_RETRIES + 1):
            self.layout.make_dir(root)
            probe = self.layout.temp_path(root / "write-check")
            try:
                fd = self.layout.fs.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                try:
                    os.write(fd, b"\0")  # a full disk refuses the first block
                finally:
                    os.close(fd)
                    self.layout.fs.unlink(probe)
                return
            except CacheDirError:
                raise
            except OSError as exc:
                # Removed right after it was made (a tmp cleaner): made again, as a miss does.
                if exc.errno not in (errno.ENOENT, errno.ESTALE) or attempt == VANISHED_RETRIES:
                    raise dir_error(root, exc, "writing a file in") from exc

    def _prefetcher(self, fetch: Fetch, urls: Iterable[str], given: dict[str, Any]) -> Prefetcher:
        """A prefetcher of ``urls`` through ``fetch``: ``given`` options over the settings';
        the cache directory is checked first (:meth:`check_dir`)."""
        self.check_dir()
        defaults = {
            option: getattr(self.settings, name) for option, name in PREFETCH_OPTIONS.items()
        }
        return Prefetcher(fetch, urls, **(defaults | given), release=self._unpin)

    # -- maintenance -----------------------------------------------------------------

    def entries(self) -> list[CacheEntry]:
        """Published shards of this scope, least recently used first, with their URLs."""
        return self._space.entries()

    def evict(self, max_bytes: int | None = None) -> EvictReport:
        """Evict least-recently-used shards (never one in use) down to ``max_bytes``
        (default SHARDCACHE_MAX_BYTES)."""
        return self._space.evict(max_bytes)

    def remove(self, path: Path) -> bool:
        """Remove a published shard and its metadata; False if missing or in use. Also
        from the scope's index when there is one (``verify`` runs without max_bytes)."""
        return self._space.remove(Path(path))
