"""WebDataset integration: a caching, prefetching stage and a drop-in ``tarfile_to_samples``.

::

    pipeline = wds.DataPipeline(
        wds.SimpleShardList("s3://bucket/train-{000000..000127}.tar"),
        shardcache.split_by_node, wds.split_by_worker,
        shardcache.tarfile_to_samples(),
        wds.decode(), wds.to_tuple("npy", "cls"))

Stages are pickled into every DataLoader worker, so they hold only plain settings until
iteration starts: the cache (when not given), the prefetch threads and the open files are
created in the process that iterates. ``wds.DataPipeline.close()`` calls :meth:`close`,
which stops every prefetcher this stage started in the calling process.

Errors follow webdataset's ``handler(exn)`` convention, called once per failed shard
(after the cache's own retries): True skips the shard, False ends the stream, raising
propagates. A :class:`~shardcache.StallError` is not a fault of one shard but of
the whole data path, so it always propagates (one raised while reading a shard that is
still downloading reaches the handler through the tar expansion first, and is raised
again when the next shard is requested). The tar expansion gives webdataset's samples,
parsed by shardcache's own tar reader (:mod:`.tar_expansion`: a third of the CPU a sample).

Read while downloading (SHARDCACHE_READ_WHILE_DOWNLOADING=on, the default): a shard this
process downloads is handed to the tar expansion once its first bytes landed, and read as
they arrive (:mod:`shardcache._store.growing`); it is still published only complete and verified.
If its verification then fails, reading it raises :class:`~shardcache.IntegrityError`,
which the tar expansion passes to the handler: the samples already yielded from that shard came
from bytes that failed verification. Such a shard's ``local_path`` names where it will be
published (it may not exist yet): read ``stream``. After the tar expansion is done with a
shard read this way, the stage waits for its verdict before the next shard, so a failure
past the tar's end-of-archive blocks reaches the handler too. With ``off``, every shard is
read only once verified.
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

import webdataset as wds

from .._base.errors import ConfigError, ShardCacheError, StallError
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._config.settings import prefetch_overrides, warn_unknown_env
from .._mesh.holders import PeerSource
from .._observe import metrics
from .._prefetch.prefetcher import Prefetcher
from .._store.growing import GrowingFile, UntilStall
from ..distributed import rank_info
from .decompressed import Opened
from .mesh_wiring import attach
from .tar_expansion import expand
from .tar_guard import TarGuard

logger = get_logger(__name__)

Handler = Callable[[BaseException], bool]
Sample = dict[str, Any]
STDIN_URL = "-"  # webdataset's gopen reads standard input for this URL


class CacheStage:
    """``{"url": ...}`` dicts in, ``{"url", "stream", "local_path", ...}`` dicts out.

    Shards are fetched through the cache by a :class:`Prefetcher` ahead of the consumer;
    every other key of the incoming dict is passed through. Each stream is closed when the
    next shard is requested (the tar expansion has then finished reading it); as it is read,
    it is decompressed if compressed and checked as a tar (:mod:`.tar_guard`: an empty,
    non-tar, truncated or damaged shard is a :class:`~shardcache.ShardFormatError`).
    The URL ``"-"`` is standard input, as in webdataset: read once, in order, uncached.
    """

    def __init__(
        self,
        handler: Handler = wds.reraise_exception,
        *,
        cache: ShardCache | None = None,
        threads: int | None = None,
        depth: int | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        _check_callable("handler", handler, optional=False)
        if cache is not None and not isinstance(cache, ShardCache):
            raise TypeError(f"cache must be a shardcache.ShardCache or None, not {_kind(cache)}")
        self.cache = cache
        if cache is None:  # resolved in the DataLoader workers, which do not warn: warn here
            warn_unknown_env()
        self.handler = handler
        # Checked now (in the constructing process), applied by cache.prefetch() over the
        # cache's settings when iteration starts.
        self.prefetch_options = prefetch_overrides(
            threads=threads, depth=depth, stall_timeout=stall_timeout
        )
        self._live: weakref.WeakSet[Prefetcher] = weakref.WeakSet()
        self.peers: PeerSource | None = None  # the cache mesh's holders, a dataset's to give

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_live"]  # prefetchers belong to the process that started them
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._live = weakref.WeakSet()

    def __call__(self, src: Iterable[Sample]) -> Iterator[Sample]:
        opened = self._opened_shards(src)
        return _epoch(_tar_guarded(opened), opened, count_samples=False)

    def opened(self, src: Iterable[Sample]) -> Iterator[Sample]:
        """The stage's shards without the end of the epoch at their end: for a caller
        that delivers more after them (``ResumableDataset`` drains its shuffle buffer)."""
        return self._opened_shards(src)

    def close(self) -> None:
        """Stop every prefetcher this stage started (cancels downloads, joins threads),
        and emit the loader metrics left since the last record (a ``close`` record and,
        in the training process, its log line)."""
        for prefetcher in list(self._live):
            prefetcher.close()
        metrics.collector().close()

    def _opened_shards(self, src: Iterable[Sample]) -> Generator[Sample, None, None]:
        cache = self.cache if self.cache is not None else ShardCache.from_env()
        if self.peers is not None:
            attach(cache, self.peers)
        source = iter(src)
        replay: deque[Sample] = deque()  # shards handed to a failed prefetcher, not yet served
        pending: deque[Sample] = deque()  # shards handed to the current prefetcher, in order
        stdin: deque[Sample] = deque()  # a "-" reached: served once the prefetcher drained

        def urls() -> Iterator[str]:
            while True:
                if replay:
                    sample = replay.popleft()
                else:
                    item = next(source, None)
                    if item is None:
                        return
                    sample = _as_sample(item)
                if sample["url"] == STDIN_URL:
                    stdin.append(sample)  # ends this prefetcher's input: order is kept
                    return
                pending.append(sample)
                yield sample["url"]

        while True:
            prefetcher = cache.prefetch_streaming(urls(), **self.prefetch_options)
            self._live.add(prefetcher)
            try:
                for shard, growing, until_stall in prefetcher.iter_early():
                    sample = pending.popleft()
                    path = str(shard.path)
                    with _open(cache, shard.path, growing, until_stall) as stream:
                        yield from _handed(
                            {**sample, "stream": stream, "local_path": path}, growing, until_stall
                        )
                    metrics.shard_delivered()
                    if growing is not None and (error := growing.verdict(until_stall)):
                        # Read (perhaps not to its end) before its verdict: a failure not yet
                        # raised by the stream goes to the handler here, once.
                        logger.debug("shard %s failed after it was read: %s", path, error)
                        if not self.handler(error):
                            return
                if not stdin:
                    return
            except StallError:
                raise
            except ShardCacheError as exn:
                if not pending:
                    raise  # from the shard list (a splitter's ConfigError), not from a shard
                failed = pending.popleft()
                logger.debug("shard %s failed: %s", failed["url"], exn)
                if not self.handler(exn):
                    return
                # The prefetcher stops at a failure: serve the shards it had pulled, then the rest.
                replay.extendleft(reversed([*pending, *stdin]))
                pending.clear()
                stdin.clear()
                continue
            finally:
                prefetcher.close()
            logger.debug("reading a shard from standard input, uncached")
            yield {**stdin.popleft(), "stream": sys.stdin.buffer}


class TarfileToSamples(CacheStage):
    """Drop-in for ``wds.tarfile_to_samples()`` that reads every shard through the cache."""

    def __init__(
        self,
        handler: Handler = wds.reraise_exception,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        *,
        cache: ShardCache | None = None,
        threads: int | None = None,
        depth: int | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        super().__init__(
            handler, cache=cache, threads=threads, depth=depth, stall_timeout=stall_timeout
        )
        _check_callable("select_files", select_files, optional=True)
        _check_callable("rename_files", rename_files, optional=True)
        self.select_files = select_files
        self.rename_files = rename_files

    def __call__(self, src: Iterable[Sample]) -> Iterator[Sample]:
        opened = self._opened_shards(src)
        samples = expand(opened, self.handler, self.select_files, self.rename_files)
        return _epoch(samples, opened)


def _tar_guarded(opened: Iterable[Sample]) -> Iterator[Sample]:
    """``opened``'s shards, each stream decompressed (:mod:`.decompressed`) and checked as
    a tar (:mod:`.tar_guard`) as the next stage reads it: webdataset's own tar reader gives
    no ``ShardFormatError``."""
    for shard in opened:
        url = shard["url"]
        yield {**shard, "stream": TarGuard(Opened(shard["stream"], url), url)}


def _handed(
    opened: Sample, growing: GrowingFile | None, until_stall: UntilStall
) -> Generator[Sample, None, None]:
    """Hand ``opened`` on. When the consumer stops with it in hand (a mixture ends a
    source's share on its last sample), its download is let publish, as when read to its
    end, before the prefetcher's close cancels what is still in flight: cancelled, it would
    be fetched again next epoch, and a peer of the cache mesh asked for it would have none."""
    try:
        yield opened
    except GeneratorExit:
        if growing is not None:
            _finish(growing, until_stall)
        raise


def _finish(growing: GrowingFile, until_stall: UntilStall) -> None:
    try:
        error = growing.verdict(until_stall)
    except ShardCacheError as exn:  # a stall: the consumer is gone, nobody to raise it to
        error = exn
    if error is not None:
        logger.debug("%s failed after its consumer stopped: %s", growing.url, error)


def _open(
    cache: ShardCache, path: Path, growing: object, until_stall: Callable[[], float]
) -> BinaryIO:
    """The stream of a prefetched shard: read as it lands while it still downloads, else
    the published file through its pin (which survives its removal)."""
    if growing is not None:
        assert isinstance(growing, GrowingFile)
        return growing.open(until_stall)
    return cache.open_prefetched(path)


SAMPLE_BATCH = 256  # samples are counted in the metrics at most this many at a time


def _epoch(
    items: Iterator[Sample], opened: Generator[Sample, None, None], *, count_samples: bool = True
) -> Iterator[Sample]:
    """``items``, counted in the loader metrics; exhausting them ends this process's epoch
    there (an early stop or an error does not). Samples are counted a shard (or
    ``SAMPLE_BATCH``) at a time, not one by one, so that records and plots follow the
    samples within a shard's time.

    ``opened`` (the opened shards ``items`` come from) is closed when this ends in any
    way: an error raised by a stage in between (the tar expansion of a damaged
    shard) leaves it suspended, held by the error's traceback, and its prefetch threads
    would run until the traceback was collected."""
    uncounted = 0
    shard = None
    try:
        for item in items:
            if count_samples:
                url = item.get("__url__")
                if uncounted and (uncounted == SAMPLE_BATCH or url != shard):
                    metrics.count(samples=uncounted)
                    uncounted = 0
                uncounted += 1
                shard = url
            yield item
    finally:
        opened.close()
        if uncounted:
            metrics.count(samples=uncounted)
    metrics.end_epoch()


def stage(
    handler: Handler = wds.reraise_exception,
    *,
    cache: ShardCache | None = None,
    threads: int | None = None,
    depth: int | None = None,
    stall_timeout: float | None = None,
) -> CacheStage:
    """A pipeline stage yielding ``{"url", "stream", "local_path"}`` for webdataset's tar
    expansion; a stream that is not a complete tar raises a ``ShardFormatError`` as it is
    read. Prefetch options left as None come from the cache's settings."""
    return CacheStage(
        handler, cache=cache, threads=threads, depth=depth, stall_timeout=stall_timeout
    )


def tarfile_to_samples(
    handler: Handler = wds.reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    *,
    cache: ShardCache | None = None,
    threads: int | None = None,
    depth: int | None = None,
    stall_timeout: float | None = None,
) -> TarfileToSamples:
    """Drop-in for ``wds.tarfile_to_samples()``: the same positional arguments, then the
    keyword-only cache and prefetch options (None: from the cache's settings)."""
    return TarfileToSamples(
        handler,
        select_files,
        rename_files,
        cache=cache,
        threads=threads,
        depth=depth,
        stall_timeout=stall_timeout,
    )


def tarfile_samples(
    src: Iterable[Sample],
    handler: Handler = wds.reraise_exception,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
    *,
    cache: ShardCache | None = None,
    threads: int | None = None,
    depth: int | None = None,
    stall_timeout: float | None = None,
) -> Iterator[Sample]:
    """Drop-in for ``wds.tariterators.tarfile_samples(src, ...)``: samples of the shards
    ``src`` names (``{"url": ...}`` dicts), read through the cache."""
    return tarfile_to_samples(
        handler,
        select_files,
        rename_files,
        cache=cache,
        threads=threads,
        depth=depth,
        stall_timeout=stall_timeout,
    )(src)


def _kind(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__} {value!r:.80}"


def _check_callable(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if callable(value):
        return
    hint = ""
    if isinstance(value, ShardCache):
        hint = f"; the cache is a keyword argument: pass cache={value!r}"
    expected = "a callable or None" if optional else "a callable"
    raise TypeError(f"{name} must be {expected}, not {_kind(value)}{hint}")


def _as_sample(item: object) -> Sample:
    """A shard-list item as a ``{"url": ...}`` dict; a bare URL string is accepted, as
    webdataset's ``StreamingOpen`` accepts it."""
    if isinstance(item, str):
        return {"url": item}
    if isinstance(item, dict) and isinstance(item.get("url"), str):
        return item
    raise TypeError(
        "shardcache's WebDataset stage expects {'url': str, ...} dicts (or URL strings) from "
        f"the shard list (wds.SimpleShardList, wds.ResampledShards), not {_kind(item)}"
    )


def split_by_node(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Like ``wds.split_by_node``, with ranks from shardcache's detection: an initialised
    torch.distributed group, then torchrun, then SLURM (which webdataset ignores)."""
    rank, world_size, _ = _ranks(group)
    if world_size > 1:
        yield from islice(src, rank, None, world_size)
    else:
        yield from src


def single_node_only(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Like ``wds.single_node_only`` (every shard, refused in a job of several ranks), with
    ranks from shardcache's detection: under ``srun`` webdataset sees one rank and lets every
    rank read every shard."""
    _, world_size, who = _ranks(group)
    if world_size > 1:
        raise ConfigError(
            f"this process is {who}, and its WebDataset has no node splitter "
            "(webdataset's default, nodesplitter=wds.single_node_only): every rank would read "
            "every shard. Pass nodesplitter=shardcache.split_by_node (each rank its own "
            "share), or nodesplitter=None if every rank is meant to read every shard.",
            name="nodesplitter",
            value="single_node_only",
        )
    yield from src


def _ranks(group: Any) -> tuple[int, int, str]:
    """This process's rank and world size in ``group`` (None: shardcache's detection), and
    who it is in words."""
    if group is not None:
        import torch.distributed as dist

        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        return rank, world_size, f"rank {rank}/{world_size} of the given process group"
    info = rank_info()
    return info.rank, info.world_size, info.describe()
