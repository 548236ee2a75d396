"""Warming a cache: which shards this task fetches, and fetching them in parallel.

:func:`plan_warm` decides what a task under a launcher is responsible for (a pure
function); :func:`warm` fetches a list of URLs with a thread pool, showing progress and
collecting every failure instead of stopping at the first.

``split="auto"`` (``"none"`` warms every URL; outside a launcher, world size 1, the two
are the same):

* rank scope: rank ``r`` of ``W`` warms ``urls[r::W]``, exactly the shards
  :func:`shardcache.split_by_node` gives it, into its own ``rank-<r>`` directory;
* node scope: only local rank 0 of each node works. It warms the union of the shares of
  the node's ranks, assuming ranks are numbered contiguously per node (torchrun, and
  SLURM's default block distribution): ranks ``rank - local_rank`` ..
  ``rank - local_rank + local_world_size - 1`` (with nodes of equal size this is
  ``node_rank * local_world_size`` ..). When the local world size is unknown, local rank 0
  warms everything. Other local ranks have nothing to do.

``--split dataset`` (:func:`plan_dataset_warm`) warms what a
:class:`shardcache.ResumableDataset` of the same shard list, seed, shard shuffling and
remainder reads through this task's cache in every epoch (:meth:`cache_urls
<shardcache.ResumableDataset.cache_urls>`), from its sample index. With node scope only
local rank 0 works, as above.

:func:`build_index` fetches every shard through the cache and learns its sample offsets
(``shardcache index``), with the same progress display as :func:`warm`.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ._cache import CacheStats, ShardCache
from ._redact import get_logger, redact_text
from ._units import format_bytes

if TYPE_CHECKING:
    from ._resumable import ResumableDataset
    from ._sample_index import SampleIndex

logger = get_logger(__name__)

SPLITS = ("auto", "none")
LOG_EVERY = 5.0  # seconds between plain progress lines when stderr is not a terminal
_BAR_REFRESH = 0.5  # seconds between progress-bar refreshes (bytes and rate)


@dataclass(frozen=True)
class WarmPlan:
    """The shards one task warms, and why (``active`` False: another task does the work)."""

    urls: list[str]
    reason: str
    active: bool = True


def plan_warm(
    urls: Sequence[str],
    *,
    split: str,
    scope: str,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int | None,
) -> WarmPlan:
    """Which of ``urls`` this task warms (see the module docstring for the rules)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    urls = list(urls)
    if split == "none" or world_size <= 1:
        why = "--split none" if split == "none" else "world size 1"
        return WarmPlan(urls, f"every shard, {why}")
    if scope == "rank":
        mine = urls[rank::world_size]
        return WarmPlan(mine, f"rank {rank} of {world_size}: shards[{rank}::{world_size}]")
    if local_rank != 0:
        return WarmPlan(
            [], f"local rank {local_rank}; local rank 0 warms this node's cache", active=False
        )
    if local_world_size is None:
        return WarmPlan(urls, "every shard, local rank 0 of a node of unknown size")
    first = rank - local_rank
    last = min(first + local_world_size, world_size) - 1
    mine = [u for i, u in enumerate(urls) if first <= i % world_size <= last]
    return WarmPlan(mine, f"the shares of ranks {first}..{last} of {world_size} on this node")


def plan_dataset_warm(
    dataset: ResumableDataset,
    *,
    scope: str,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int | None,
) -> WarmPlan:
    """The shards of ``dataset`` this task's cache reads in every epoch (``--split dataset``).

    Rank scope, or a node of ``local_world_size`` ranks when that divides the world (the
    dataset then splits by node): ``dataset.cache_urls()``. Node scope when the dataset
    splits by rank instead (node size unknown or uneven): local rank 0 warms the union of
    what the node's ranks (contiguous, as :func:`plan_warm` assumes) read, every shard when
    the node size is unknown. Other local ranks have nothing to do. ``dataset``'s rank and
    world size must be the ones given here (leave them to detection)."""
    what = "the dataset's split"
    if world_size <= 1:
        return WarmPlan(dataset.cache_urls(), f"{what}, world size 1: every shard with samples")
    if scope == "rank":
        return WarmPlan(
            dataset.cache_urls(),
            f"{what}: what rank {rank} of {world_size} reads in every epoch",
        )
    if local_rank != 0:
        return WarmPlan(
            [], f"local rank {local_rank}; local rank 0 warms this node's cache", active=False
        )
    if local_world_size is None:
        return WarmPlan(
            _rank_cache_urls(dataset, [0], 1),
            f"{what}: every shard with samples, local rank 0 of a node of unknown size",
        )
    first = rank - local_rank
    last = min(first + local_world_size, world_size) - 1
    if world_size % local_world_size == 0:
        urls = dataset.cache_urls()
    else:  # the dataset gives each rank its own part: the node reads its ranks' parts
        urls = _rank_cache_urls(dataset, range(first, last + 1), world_size)
    return WarmPlan(urls, f"{what}: what ranks {first}..{last} of {world_size} on this node read")


def _rank_cache_urls(dataset: ResumableDataset, ranks: Iterable[int], world_size: int) -> list[str]:
    """The union of ``cache_urls()`` of ``ranks`` of ``world_size``, each its own cache, in
    shard-list order."""
    dataset.prepare()  # the copies share the loaded index and split
    wanted: set[str] = set()
    for rank in ranks:
        one = copy.copy(dataset)
        one.rank, one.world_size = rank, world_size
        wanted.update(one.cache_urls())
    return [url for url in dict.fromkeys(dataset.urls) if url in wanted]


@dataclass(frozen=True)
class WarmFailure:
    """One shard that could not be warmed."""

    url: str
    error: str  # "<ExceptionType>: <message on one line>"


@dataclass
class WarmResult:
    """What one :func:`warm` run did; hits/misses/shared count this run only."""

    scope_dir: Path
    total: int
    ok: int = 0
    failed: list[WarmFailure] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    shared: int = 0
    bytes_served: int = 0  # size of the shards now in the cache
    bytes_downloaded: int = 0  # by this run
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        """Download rate of this run (MB = 10**6 bytes)."""
        return self.bytes_downloaded / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """A summary line, then one line per failed shard."""
        lines = [
            f"warm: {self.ok} of {self.total} shards ok, {len(self.failed)} failed "
            f"(hits {self.hits}, misses {self.misses}, shared {self.shared}); "
            f"{format_bytes(self.bytes_served)} cached, {format_bytes(self.bytes_downloaded)} "
            f"downloaded in {self.seconds:.1f} s ({self.mb_per_s:.1f} MB/s); "
            f"cache {self.scope_dir}"
        ]
        if self.failed:
            lines.append(f"failed shards ({len(self.failed)}):")
            lines += [redact_text(f"  {f.url}: {f.error}") for f in self.failed]
        return "\n".join(lines)


class _Cancelled(BaseException):
    """Raised from a progress callback to unwind a download (its .part is removed)."""


class _Progress:
    """Progress on ``stream``: a tqdm bar on a terminal, else a plain line every ``every`` s."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None,
        every: float,
        *,
        label: str = "warm",
        downloaded: Callable[[], int] | None = None,
        failures: bool = True,
    ) -> None:
        self.total = total
        self.stream = stream
        self.every = every
        self.label = label
        self._failures = failures  # whether the line counts failed shards (warm goes on)
        self._downloaded = downloaded  # bytes downloaded so far, when not reported by moved()
        self.done = 0
        self.failed = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}  # url -> bytes it reported so far
        self._finished_bytes = 0  # bytes reported by shards that finished
        self._stop = threading.Event()
        self._bar = None
        self._thread: threading.Thread | None = None
        if stream is None:
            return
        if _isatty(stream):
            from tqdm import tqdm

            sized = _columns(stream) > 0  # a pty without a size would get an empty bar
            self._bar = tqdm(
                total=total,
                unit="shard",
                desc=label,
                file=stream,
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                postfix="0 B, 0.0 MB/s",
            )
        self._thread = threading.Thread(target=self._tick, name="shardcache-warm-progress")
        self._thread.daemon = True
        self._thread.start()

    def moved(self, url: str, bytes_done: int) -> None:
        with self._lock:
            self._in_flight[url] = bytes_done

    def finished(self, url: str, ok: bool) -> None:
        with self._lock:
            self._finished_bytes += self._in_flight.pop(url, 0)
            self.done += 1
            self.failed += not ok
            if self._bar is not None:
                self._bar.update(1)

    def line(self) -> str:
        with self._lock:
            done, failed, moved = self.done, self.failed, self._moved()
        elapsed = time.monotonic() - self.started
        rate = moved / 1e6 / elapsed if elapsed > 0 else 0.0
        if done == self.total:
            eta = "done"
        else:
            eta = "ETA ?" if done == 0 else f"ETA {elapsed / done * (self.total - done):.0f}s"
        failures = f" ({failed} failed)" if self._failures else ""
        return (
            f"{self.label}: {done}/{self.total} shards{failures}, {format_bytes(moved)} "
            f"downloaded, {rate:.1f} MB/s, elapsed {elapsed:.1f}s, {eta}"
        )

    def _postfix(self) -> str:
        with self._lock:
            moved = self._moved()
        elapsed = time.monotonic() - self.started
        rate = moved / 1e6 / elapsed if elapsed > 0 else 0.0
        return f"{format_bytes(moved)}, {rate:.1f} MB/s"

    def _moved(self) -> int:
        """Bytes moved into the cache by this run so far (call with ``_lock`` held)."""
        if self._downloaded is not None:
            return self._downloaded()
        return self._finished_bytes + sum(self._in_flight.values())

    def _tick(self) -> None:
        every = _BAR_REFRESH if self._bar is not None else self.every
        while not self._stop.wait(every):
            self._show()

    def _show(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix())
        elif self.stream is not None:
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.stream is not None:
            self._show()  # the final state
        if self._bar is not None:
            self._bar.close()


def _threads(cache: ShardCache, threads: int | None) -> int:
    threads = cache.settings.threads if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    return threads


def warm(
    cache: ShardCache,
    urls: Sequence[str],
    *,
    threads: int | None = None,
    stream: TextIO | None = None,
    log_every: float = LOG_EVERY,
) -> WarmResult:
    """Fetch every URL into ``cache`` with ``threads`` downloads at a time.

    A failed shard does not stop the others: failures are collected in the result, in
    input order. Progress goes to ``stream`` (a tqdm bar when it is a terminal, else a
    plain line every ``log_every`` seconds and at the end); None shows none. On
    ``KeyboardInterrupt`` downloads in flight are unwound (no temp file stays) and the
    interrupt propagates.
    """
    threads = _threads(cache, threads)
    urls = list(urls)
    before = cache.stats()
    started = time.monotonic()
    progress = _Progress(len(urls), stream, log_every)
    stop = threading.Event()
    errors: dict[int, WarmFailure] = {}

    def fetch_one(index: int, url: str) -> None:
        def report(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
            if stop.is_set():
                raise _Cancelled
            progress.moved(url, bytes_done)

        try:
            cache.fetch(url, progress=report)
        except Exception as exc:
            errors[index] = WarmFailure(url, f"{type(exc).__name__}: {_one_line(exc)}")
            progress.finished(url, ok=False)
            logger.debug("warming %s failed", url, exc_info=True)
        else:
            progress.finished(url, ok=True)

    pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="shardcache-warm")
    pending: set[cf.Future[None]] = set()
    try:
        for index, url in enumerate(urls):
            if len(pending) >= 2 * threads:  # bounded queue: 10M URLs need not be 10M futures
                _, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            pending.add(pool.submit(fetch_one, index, url))
        cf.wait(pending)
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)
        progress.close()
    after = cache.stats()
    failed = [errors[i] for i in sorted(errors)]
    return WarmResult(
        scope_dir=cache.settings.scope_dir,
        total=len(urls),
        ok=len(urls) - len(failed),
        failed=failed,
        **_delta(before, after),
        seconds=time.monotonic() - started,
    )


@dataclass
class IndexResult:
    """What one :func:`build_index` run found: every shard's samples (in ``urls`` order)
    and the cache activity of this run."""

    scope_dir: Path
    urls: list[str]
    index: SampleIndex
    misses: int = 0  # shards this run downloaded
    shared: int = 0  # shards another process downloaded while this run waited
    bytes_downloaded: int = 0
    seconds: float = 0.0

    @property
    def cached(self) -> int:
        """Shards that were in the cache already."""
        return max(0, len(set(self.urls)) - self.misses - self.shared)

    @property
    def samples(self) -> int:
        return sum(self.index[url].count for url in self.urls)

    @property
    def bytes_indexed(self) -> int:
        return sum(self.index[url].size for url in self.urls)

    @property
    def empty(self) -> list[str]:
        """Shards that hold no sample (left out of every epoch)."""
        return [url for url in self.urls if self.index[url].count == 0]

    def summary(self, target: str) -> str:
        """A summary line, then a warning about shards without samples, if any."""
        lines = [
            f"index: {len(self.urls)} shards, {self.samples} samples, "
            f"{format_bytes(self.bytes_indexed)} indexed in {self.seconds:.1f} s (cached "
            f"{self.cached}, misses {self.misses}, shared {self.shared}; "
            f"{format_bytes(self.bytes_downloaded)} downloaded); written to "
            f"{redact_text(target)}"
        ]
        empty = self.empty
        if empty:
            lines.append(
                f"warning: {len(empty)} of {len(self.urls)} shards hold no sample (no member "
                "named key.suffix) and are left out of every epoch:"
            )
            lines += [redact_text(f"  {url}") for url in empty[:_EMPTY_LISTED]]
            if len(empty) > _EMPTY_LISTED:
                lines.append(f"  ... and {len(empty) - _EMPTY_LISTED} more (--json lists all)")
        return "\n".join(lines)

    def as_json(self, target: str) -> dict[str, object]:
        return {
            "index": redact_text(target),
            "shards": len(self.urls),
            "samples": self.samples,
            "bytes_indexed": self.bytes_indexed,
            "seconds": round(self.seconds, 3),
            "cached": self.cached,
            "misses": self.misses,
            "shared": self.shared,
            "bytes_downloaded": self.bytes_downloaded,
            "cache": str(self.scope_dir),
            "empty_shards": [redact_text(url) for url in self.empty],
            "warnings": [f"{len(self.empty)} of {len(self.urls)} shards hold no sample"]
            if self.empty
            else [],
        }


_EMPTY_LISTED = 20  # shards without samples named by the summary (all with --json)


def build_index(
    cache: ShardCache,
    urls: Sequence[str],
    *,
    threads: int | None = None,
    stream: TextIO | None = None,
    log_every: float = LOG_EVERY,
) -> IndexResult:
    """Fetch every URL through ``cache`` (``threads`` at a time) and learn its samples
    (:func:`shardcache._sample_index.learn`); progress on ``stream`` as :func:`warm` shows
    it. The first shard that fails stops the run: its error is raised."""
    from ._sample_index import learn

    threads = _threads(cache, threads)
    urls = list(urls)
    before = cache.stats()
    started = time.monotonic()
    progress = _Progress(
        len(urls),
        stream,
        log_every,
        label="index",
        downloaded=lambda: cache.stats().bytes_downloaded - before.bytes_downloaded,
        failures=False,
    )
    try:
        index = learn(
            urls,
            cache,
            threads=threads,
            on_done=lambda url: progress.finished(url, ok=True),
        )
    finally:
        progress.close()
    after = cache.stats()
    return IndexResult(
        scope_dir=cache.settings.scope_dir,
        urls=urls,
        index=index,
        misses=after.misses - before.misses,
        shared=after.shared - before.shared,
        bytes_downloaded=after.bytes_downloaded - before.bytes_downloaded,
        seconds=time.monotonic() - started,
    )


def _delta(before: CacheStats, after: CacheStats) -> dict[str, int]:
    return {
        "hits": after.hits - before.hits,
        "misses": after.misses - before.misses,
        "shared": after.shared - before.shared,
        "bytes_served": after.bytes_served - before.bytes_served,
        "bytes_downloaded": after.bytes_downloaded - before.bytes_downloaded,
    }


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


__all__ = [
    "IndexResult",
    "WarmFailure",
    "WarmPlan",
    "WarmResult",
    "build_index",
    "plan_dataset_warm",
    "plan_warm",
    "warm",
]
