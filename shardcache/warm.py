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
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ._base.errors import (
    IntegrityError,
    LockTimeout,
    PipeCommandError,
    RemoteIsADirectoryError,
    RemoteNotFoundError,
    ShardFormatError,
)
from ._base.redact import get_logger, redact_text
from ._base.units import format_bytes
from ._cache.shard_cache import ShardCache
from ._ops.fetch_progress import LOG_EVERY, FetchProgress, stats_delta, thread_count
from ._ops.index_build import IndexResult, build_index

if TYPE_CHECKING:
    from ._datasets.resumable import ResumableDataset

logger = get_logger(__name__)

SPLITS = ("auto", "none")
SAME_ERROR_STOP = 5
"""warm stops when this many shards in a row fail with the same error that is not about the
shard itself (the cache directory, the credentials, the store unreachable): the rest would too."""
SHARD_ERRORS = (
    RemoteNotFoundError,
    RemoteIsADirectoryError,
    IntegrityError,
    ShardFormatError,
    PipeCommandError,
    LockTimeout,
)
"""Errors about one shard: never a reason to stop warming the others."""
FAILURES_LISTED = 5  # URLs listed per kind of error in the summary (as_json lists all)


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
    """What one :func:`warm` run did; hits/misses/shared count this run only.

    ``stopped`` says why the run stopped before trying every shard (``not_attempted`` of
    them): ``max_failures`` reached, or :data:`SAME_ERROR_STOP` shards in a row failed with
    the same error that is not about the shard itself."""

    scope_dir: Path
    total: int
    ok: int = 0
    failed: list[WarmFailure] = field(default_factory=list)
    not_attempted: int = 0
    stopped: str | None = None
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
        """A summary line, then the failed shards grouped by error: one line per kind of
        error, with up to :data:`FAILURES_LISTED` of its shards."""
        skipped = f", {self.not_attempted} not attempted" if self.not_attempted else ""
        lines = [
            f"warm: {self.ok} of {self.total} shards ok, {len(self.failed)} failed{skipped} "
            f"(hits {self.hits}, misses {self.misses}, shared {self.shared}); "
            f"{format_bytes(self.bytes_served)} cached, {format_bytes(self.bytes_downloaded)} "
            f"downloaded in {self.seconds:.1f} s ({self.mb_per_s:.1f} MB/s); "
            f"cache {self.scope_dir}"
        ]
        if self.stopped is not None:
            lines.append(f"stopped early: {self.stopped}")
        if self.failed:
            lines.append(f"failed shards ({len(self.failed)}):")
        for error, urls in _by_error(self.failed).items():
            if len(urls) == 1:
                lines.append(redact_text(f"  {urls[0]}: {error.replace(_URL, urls[0])}"))
                continue
            lines.append(redact_text(f"  {len(urls)} shards: {error}"))
            lines += [redact_text(f"    {url}") for url in urls[:FAILURES_LISTED]]
            if len(urls) > FAILURES_LISTED:
                lines.append(f"    ... and {len(urls) - FAILURES_LISTED} more (--json lists all)")
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        """The result as JSON: every failed shard with its error."""
        return {
            "scope_dir": str(self.scope_dir),
            "total": self.total,
            "ok": self.ok,
            "failed": [
                {"url": redact_text(f.url), "error": redact_text(f.error)} for f in self.failed
            ],
            "not_attempted": self.not_attempted,
            "stopped": self.stopped,
            "hits": self.hits,
            "misses": self.misses,
            "shared": self.shared,
            "bytes_served": self.bytes_served,
            "bytes_downloaded": self.bytes_downloaded,
            "seconds": round(self.seconds, 3),
        }


_URL = "<url>"


def _by_error(failed: list[WarmFailure]) -> dict[str, list[str]]:
    """The failed shards' URLs by their error, the URL in it written as ``<url>``."""
    groups: dict[str, list[str]] = {}
    for failure in failed:
        error = failure.error.replace(failure.url, _URL).replace(redact_text(failure.url), _URL)
        groups.setdefault(error, []).append(failure.url)
    return groups


class _Stopper:
    """Decides when a warm run stops early (``reason`` set): at once for an error about the
    whole store (``store_wide``: a missing bucket, a refused connection), after
    ``max_failures`` failed shards, or after :data:`SAME_ERROR_STOP` failures in a row of
    one error type not in :data:`SHARD_ERRORS`."""

    def __init__(self, max_failures: int | None) -> None:
        self.max_failures = max_failures
        self.reason: str | None = None
        self._lock = threading.Lock()
        self.attempted = 0
        self._failures = 0
        self._streak: tuple[type[BaseException] | None, int] = (None, 0)

    def start(self) -> bool:
        """Whether the next shard is to be tried (then counted as attempted)."""
        with self._lock:
            self.attempted += self.reason is None
            return self.reason is None

    def succeeded(self) -> None:
        with self._lock:
            self._streak = (None, 0)

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self._failures += 1
            kind, count = self._streak
            self._streak = (type(exc), count + 1 if kind is type(exc) else 1)
            if self.reason is not None:
                return
            if getattr(exc, "store_wide", False):
                self.reason = (
                    f"{type(exc).__name__} is about the store, not one shard (every shard would "
                    "fail alike): fix it and run warm again"
                )
            elif self.max_failures is not None and self._failures >= self.max_failures:
                self.reason = f"{self._failures} shards failed (max_failures {self.max_failures})"
            elif self._streak[1] >= SAME_ERROR_STOP and not isinstance(exc, SHARD_ERRORS):
                self.reason = (
                    f"{SAME_ERROR_STOP} shards in a row failed with {type(exc).__name__}, an "
                    "error that is not about one shard (the other shards would fail alike): fix "
                    "it and run warm again, which fetches only what is missing"
                )


class _Cancelled(BaseException):
    """Raised from a progress callback to unwind a download (its .part is removed)."""


def warm(
    cache: ShardCache,
    urls: Sequence[str],
    *,
    threads: int | None = None,
    stream: TextIO | None = None,
    log_every: float = LOG_EVERY,
    max_failures: int | None = None,
) -> WarmResult:
    """Fetch every URL into ``cache`` with ``threads`` downloads at a time.

    A failed shard does not stop the others: failures are collected in the result, in
    input order. The run stops early, leaving the rest ``not_attempted``, after
    ``max_failures`` failed shards (None: no limit) or when :data:`SAME_ERROR_STOP` shards
    in a row fail with the same error that is not about the shard itself. Progress goes to
    ``stream`` (a tqdm bar when it is a terminal, else a plain line every ``log_every``
    seconds and at the end); None shows none. On ``KeyboardInterrupt`` (or any exception in
    the calling thread) downloads in flight are unwound at their next bytes (no temp file
    stays; ``stream`` is told first) and the exception propagates. A cache directory that
    cannot be used raises :class:`~shardcache.CacheDirError` before anything is fetched.
    """
    threads = thread_count(cache, threads)
    if max_failures is not None and max_failures < 1:
        raise ValueError(f"max_failures must be at least 1 or None, got {max_failures}")
    urls = list(urls)
    cache.check_dir()  # a directory that cannot be used: one error, before any download
    before = cache.stats()
    started = time.monotonic()
    progress = FetchProgress(len(urls), stream, log_every)
    stop = threading.Event()
    stopper = _Stopper(max_failures)
    errors: dict[int, WarmFailure] = {}

    def fetch_one(index: int, url: str) -> None:
        def report(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
            if stop.is_set():
                raise _Cancelled
            progress.moved(url, bytes_done)

        if not stopper.start():
            return  # queued before the run stopped: not attempted
        try:
            cache.fetch(url, progress=report)
        except Exception as exc:
            errors[index] = WarmFailure(url, f"{type(exc).__name__}: {_one_line(exc)}")
            stopper.failed(exc)
            progress.finished(url, ok=False)
            logger.debug("warming %s failed", url, exc_info=True)
        else:
            stopper.succeeded()
            progress.finished(url, ok=True)

    pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="shardcache-warm")
    pending: set[cf.Future[None]] = set()
    try:
        for index, url in enumerate(urls):
            if len(pending) >= 2 * threads:  # bounded queue: 10M URLs need not be 10M futures
                _, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            if stopper.reason is not None:
                break
            pending.add(pool.submit(fetch_one, index, url))
        cf.wait(pending)
    except BaseException:
        stop.set()
        if stream is not None:
            stream.write(
                "warm: stopping: cancelling the downloads in flight, removing their temp files\n"
            )
            stream.flush()
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
        ok=stopper.attempted - len(failed),
        failed=failed,
        not_attempted=len(urls) - stopper.attempted,
        stopped=stopper.reason,
        **stats_delta(before, after),
        seconds=time.monotonic() - started,
    )


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
