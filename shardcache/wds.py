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
propagates. A :class:`~shardcache.errors.StallError` is not a fault of one shard but of
the whole data path, so it always propagates.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import webdataset as wds

from .cache import ShardCache
from .distributed import rank_info
from .errors import ShardCacheError, StallError
from .prefetch import Prefetcher

logger = logging.getLogger(__name__)

Handler = Callable[[BaseException], bool]
Sample = dict[str, Any]
_PREFETCH_OPTIONS = frozenset({"threads", "depth", "stall_timeout"})


class CacheStage:
    """``{"url": ...}`` dicts in, ``{"url", "stream", "local_path", ...}`` dicts out.

    Shards are fetched through the cache by a :class:`Prefetcher` ahead of the consumer;
    every other key of the incoming dict is passed through. Each stream is closed when the
    next shard is requested (webdataset's tar expansion has then finished reading it).
    """

    def __init__(
        self,
        cache: ShardCache | None = None,
        handler: Handler = wds.reraise_exception,
        **prefetch_options: Any,
    ) -> None:
        unknown = set(prefetch_options) - _PREFETCH_OPTIONS
        if unknown:
            raise TypeError(
                f"unknown prefetch option(s) {sorted(unknown)}; expected some of "
                f"{sorted(_PREFETCH_OPTIONS)}"
            )
        self.cache = cache
        self.handler = handler
        self.prefetch_options = prefetch_options
        self._live: weakref.WeakSet[Prefetcher] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_live"]  # prefetchers belong to the process that started them
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._live = weakref.WeakSet()

    def __call__(self, src: Iterable[Sample]) -> Iterator[Sample]:
        return self._opened_shards(src)

    def close(self) -> None:
        """Stop every prefetcher this stage started (cancels downloads, joins threads)."""
        for prefetcher in list(self._live):
            prefetcher.close()

    def _opened_shards(self, src: Iterable[Sample]) -> Iterator[Sample]:
        cache = self.cache if self.cache is not None else ShardCache.from_env()
        source = iter(src)
        replay: deque[Sample] = deque()  # shards handed to a failed prefetcher, not yet served
        pending: deque[Sample] = deque()  # shards handed to the current prefetcher, in order

        def urls() -> Iterator[str]:
            while True:
                sample = replay.popleft() if replay else next(source, None)
                if sample is None:
                    return
                pending.append(sample)
                yield sample["url"]

        while True:
            prefetcher = cache.prefetch(urls(), **self.prefetch_options)
            self._live.add(prefetcher)
            try:
                for _url, path in prefetcher:
                    sample = pending.popleft()
                    with cache.open_prefetched(path) as stream:  # pinned, survives rm
                        yield {**sample, "stream": stream, "local_path": str(path)}
                return
            except StallError:
                raise
            except ShardCacheError as exn:
                failed = pending.popleft()
                logger.debug("shard %s failed: %s", failed["url"], exn)
                if not self.handler(exn):
                    return
                # The prefetcher stops at a failure: serve the shards it had pulled, then the rest.
                replay.extendleft(reversed(pending))
                pending.clear()
            finally:
                prefetcher.close()


class TarfileToSamples(CacheStage):
    """Drop-in for ``wds.tarfile_to_samples()`` that reads every shard through the cache."""

    def __init__(
        self,
        cache: ShardCache | None = None,
        handler: Handler = wds.reraise_exception,
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        **prefetch_options: Any,
    ) -> None:
        super().__init__(cache, handler, **prefetch_options)
        self.select_files = select_files
        self.rename_files = rename_files

    def __call__(self, src: Iterable[Sample]) -> Iterator[Sample]:
        files = wds.tariterators.tar_file_expander(
            self._opened_shards(src),
            handler=self.handler,
            select_files=self.select_files,
            rename_files=self.rename_files,
        )
        return wds.tariterators.group_by_keys(files, handler=self.handler)


def stage(
    cache: ShardCache | None = None,
    handler: Handler = wds.reraise_exception,
    **prefetch_options: Any,
) -> CacheStage:
    """A pipeline stage yielding ``{"url", "stream", "local_path"}`` for webdataset's tar
    expansion; ``prefetch_options``: ``threads``, ``depth``, ``stall_timeout``."""
    return CacheStage(cache, handler, **prefetch_options)


def tarfile_to_samples(
    cache: ShardCache | None = None,
    handler: Handler = wds.reraise_exception,
    **options: Any,
) -> TarfileToSamples:
    """Drop-in for ``wds.tarfile_to_samples()``; ``options``: ``select_files``,
    ``rename_files``, and the prefetch options ``threads``, ``depth``, ``stall_timeout``."""
    return TarfileToSamples(cache, handler, **options)


def split_by_node(src: Iterable[Any], group: Any = None) -> Iterator[Any]:
    """Like ``wds.split_by_node``, with ranks from shardcache's detection: an initialised
    torch.distributed group, then torchrun, then SLURM (which webdataset ignores)."""
    if group is not None:
        import torch.distributed as dist

        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
    else:
        info = rank_info()
        rank, world_size = info.rank, info.world_size
    if world_size > 1:
        yield from islice(src, rank, None, world_size)
    else:
        yield from src
