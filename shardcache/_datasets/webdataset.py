"""``shardcache.WebDataset``: webdataset's ``WebDataset``, reading shards through the cache.

::

    ds = shardcache.WebDataset(urls, shardshuffle=100, nodesplitter=wds.split_by_node)
    ds = ds.shuffle(1000).decode("pil").to_tuple("jpg", "cls")
    loader = wds.WebLoader(ds, batch_size=64, num_workers=4)

Design: a subclass of ``wds.WebDataset`` whose constructor runs webdataset's own (shard
list, node and worker splitters, shard shuffle, ``empty_check``) and then swaps the three
stages that read shards, webdataset's opener (``cache.StreamingOpen``), tar expander and
grouper, for one :class:`shardcache._datasets.wds.TarfileToSamples` (cache, prefetcher, stall
diagnostics). The stages are found by type and by the function they wrap, and a
webdataset whose layout differs fails at construction, naming what it found. This keeps
every behaviour of webdataset's constructor and every fluent method (``shuffle``,
``decode``, ``with_epoch``, ...) by inheritance instead of by a copy that would drift from
the installed webdataset. ``wds.WebLoader`` needs no counterpart: it wraps
``torch.utils.data.DataLoader`` around any dataset and reads nothing itself (and an alias
of webdataset's class would not be a ``shardcache`` class).

What differs from webdataset 1.0.2:

- ``cache_dir`` (or ``WDS_CACHE``) roots a :class:`~shardcache.ShardCache` there (shards in
  ``<cache_dir>/rank-<R>``, or ``/node`` at node scope), ``cache_size`` (or
  ``WDS_CACHE_SIZE``) > 0 becomes its ``max_bytes``; logged once, at construction (1.0.2
  reads the variables too, but builds its cache from the arguments alone). Without them,
  shardcache's default cache (``SHARDCACHE_*``) is used: this class always caches, so
  ``cache_size=0`` (webdataset: "do not cache") uses the default cache too.
  ``url_to_name``, ``verbose`` and ``repeat`` mean nothing, as in 1.0.2.
- ``nodesplitter=wds.split_by_node`` (and the default, ``wds.single_node_only``) become
  :func:`shardcache.split_by_node` (and its ``single_node_only``): the same split wherever
  webdataset's see the ranks, and also right under plain ``srun``, where webdataset's see
  one rank and every rank would read every shard (the default then raises, as webdataset's
  does under torch.distributed).
- ``__local_path__`` names the cached copy, not the source file.
- A directory URL (``DirectoryShardList``, a work queue that renames each file while it is
  served) is refused: reading ahead of it would race its renames.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import webdataset as wds
from webdataset import cache as wds_cache
from webdataset import shardlists
from webdataset.filters import FilterFunction, reraise_exception
from webdataset.tariterators import group_by_keys, tar_file_expander

from .._base.errors import ConfigError, ShardCacheError, UrlError
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._config.borrowed import webdataset_cache
from .wds import Handler, TarfileToSamples, single_node_only, split_by_node

logger = get_logger(__name__)

__all__ = ["WebDataset"]


class WebDataset(wds.WebDataset):
    """``wds.WebDataset`` with every shard read through shardcache's cache and prefetcher.

    The arguments are webdataset's (same order and defaults), then shardcache's keyword-only
    ``cache``, ``threads``, ``depth`` and ``stall_timeout`` (None: from the cache's
    settings). ``cache_dir`` (or ``WDS_CACHE``) roots a :class:`~shardcache.ShardCache`
    there, bounded by ``cache_size`` (or ``WDS_CACHE_SIZE``) when > 0; without it the cache
    comes from ``SHARDCACHE_*``. ``cache`` and ``cache_dir``/``cache_size`` together are a
    :class:`~shardcache.ConfigError`.
    """

    def __init__(  # noqa: PLR0917 (webdataset's positional signature)
        self,
        urls: Any,
        handler: Handler = reraise_exception,  # compat's own, not wds.reraise_exception
        mode: str | None = None,
        resampled: bool = False,
        repeat: bool = False,
        shardshuffle: int | bool | None = None,
        cache_size: int = -1,
        cache_dir: str | os.PathLike[str] | None = None,
        url_to_name: Callable[[str], str] = wds_cache.pipe_cleaner,
        detshuffle: bool = False,
        nodesplitter: Callable[[Iterable[Any]], Iterator[Any]] | None = (
            shardlists.single_node_only
        ),
        workersplitter: Callable[[Iterable[Any]], Iterator[Any]] | None = (
            shardlists.split_by_worker
        ),
        select_files: Callable[[str], bool] | None = None,
        rename_files: Callable[[str], str] | None = None,
        empty_check: bool = True,
        verbose: bool = False,
        seed: int | None = None,
        *,
        cache: ShardCache | None = None,
        threads: int | None = None,
        depth: int | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        # Checked before webdataset's constructor runs (a wrong type names its argument).
        reader = TarfileToSamples(
            handler,
            select_files,
            rename_files,
            cache=cache,
            threads=threads,
            depth=depth,
            stall_timeout=stall_timeout,
        )
        if isinstance(urls, str) and urlparse(urls).path.endswith("/"):  # webdataset's rule
            raise UrlError(
                f"shardcache.WebDataset cannot read the directory URL {urls!r}: webdataset "
                "serves a directory as a work queue (each file renamed while it is read, "
                "never ending), which a cache reading ahead would race. Pass the shards "
                "instead (a brace pattern, a list or '@manifest.txt'), or use wds.WebDataset "
                "for a directory queue.",
                url=urls,
            )
        # webdataset's own cache stays off (cache_dir=None); ours is resolved here.
        mapped = _cache_from_wds_options(cache, cache_dir, cache_size)
        nodesplitter = next((o for w, o in _OUR_SPLITTERS if nodesplitter is w), nodesplitter)
        super().__init__(
            urls,
            handler,
            mode,
            resampled,
            repeat,
            shardshuffle,
            -1,
            None,
            url_to_name,
            detshuffle,
            nodesplitter,
            workersplitter,
            select_files,
            rename_files,
            empty_check,
            verbose,
            seed,
        )
        if mapped is not None:
            reader.cache, message = mapped
            logger.info("%s", message)
        _replace_readers(self.pipeline, reader)

    def update_cache_info(self, args: Any) -> None:
        """Nothing: ``cache_dir``, ``cache_size`` and ``WDS_CACHE*`` were mapped to
        shardcache's cache before webdataset's constructor ran."""


# webdataset's node splitters read ranks from torch.distributed and RANK/WORLD_SIZE only:
# under plain srun every rank would read every shard. Ours give the same split wherever
# webdataset's see the ranks, and read SLURM's too.
_OUR_SPLITTERS = (
    (shardlists.split_by_node, split_by_node),
    (shardlists.single_node_only, single_node_only),
)


def _cache_from_wds_options(
    cache: ShardCache | None, cache_dir: str | os.PathLike[str] | None, cache_size: int
) -> tuple[ShardCache | None, str] | None:
    """The cache webdataset's cache options (the variables ``WDS_CACHE``/``WDS_CACHE_SIZE``,
    else the arguments) ask for (None: shardcache's default cache), with the line that says
    so; None if they ask for nothing."""
    if cache is not None:
        given = [n for n, v in (("cache_dir", cache_dir), ("cache_size", cache_size != -1)) if v]
        if given:
            raise ConfigError(
                f"shardcache.WebDataset got cache={cache!r} and {' and '.join(given)}: both "
                "name the cache. Pass one: cache=ShardCache(dir, max_bytes=...) or "
                "cache_dir=dir (with cache_size=bytes).",
                name=", ".join(["cache", *given]),
                value=str(cache_dir) if cache_dir is not None else cache_size,
            )
        if webdataset_cache()[0] is not None:
            logger.info("shardcache.WebDataset: WDS_CACHE ignored, cache=%r given", cache)
        return None
    env_dir, env_size = webdataset_cache()
    # As in webdataset: the variables win over the arguments.
    where = "WDS_CACHE" if env_dir is not None else "cache_dir"
    directory = env_dir if env_dir is not None else cache_dir
    if directory is None:
        return None
    size_name = "WDS_CACHE_SIZE" if env_size is not None else "cache_size"
    size = _size(env_size, size_name) if env_size is not None else cache_size
    if isinstance(size, bool) or not isinstance(size, int):
        raise ConfigError(
            f"shardcache.WebDataset: {size_name}={size!r} is not a number of bytes; expected "
            "an int (> 0: the cache's size bound, -1: unbounded).",
            name=size_name,
            value=size,
        )
    if size == 0:
        return None, (
            f"shardcache.WebDataset: {size_name}=0 turns webdataset's cache off; shards are "
            f"cached by shardcache's default cache instead ({where}={directory!s} not used)"
        )
    path = Path(os.fspath(directory)).expanduser()
    if not path.is_dir():
        seen = "does not exist" if not path.exists() else "is not a directory"
        raise ConfigError(
            f"shardcache.WebDataset: {where}={os.fspath(directory)!r} {seen}; expected an "
            f"existing directory (as webdataset requires). Create it (mkdir -p {path}), or "
            "leave cache_dir unset to use shardcache's cache (SHARDCACHE_DIR).",
            name=where,
            value=os.fspath(directory),
        )
    max_bytes = size if size > 0 else None
    made = ShardCache(path, max_bytes=max_bytes)
    bound = f"max_bytes={size}" if max_bytes else "unbounded"
    return made, (
        f"shardcache.WebDataset: {where}={path} is cached by {made!r} ({bound}), "
        "not webdataset's FileCache"
    )


def _size(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{name}={text!r} is not a number of bytes; expected an int such as 10000000000 "
            "(> 0: the cache's size bound, -1: unbounded).",
            name=name,
            value=text,
        ) from None


def _replace_readers(pipeline: list[Any], reader: TarfileToSamples) -> None:
    """Put ``reader`` in place of webdataset's opener, tar expander and grouper (adjacent,
    in that order), found by type and by the function each wraps."""

    def wraps(step: Any, function: Callable[..., Any]) -> bool:
        return isinstance(step, FilterFunction) and step.f is function

    openers = [i for i, s in enumerate(pipeline) if isinstance(s, wds_cache.StreamingOpen)]
    if len(openers) == 1:
        i = openers[0]
        rest = pipeline[i + 1 : i + 3]
        if len(rest) == 2 and wraps(rest[0], tar_file_expander) and wraps(rest[1], group_by_keys):
            pipeline[i : i + 3] = [reader]
            return
    raise ShardCacheError(
        f"shardcache.WebDataset cannot find the stages it replaces in webdataset "
        f"{getattr(wds, '__version__', '?')}'s WebDataset: expected one StreamingOpen followed "
        f"by tar_file_expander and group_by_keys stages, found {[_name(s) for s in pipeline]}. "
        "shardcache.WebDataset is built on webdataset 1.0.2's layout: install that release, "
        "or build the pipeline with wds.DataPipeline and shardcache.tarfile_to_samples().",
        stages=[_name(s) for s in pipeline],
    )


def _name(step: Any) -> str:
    if isinstance(step, FilterFunction):
        return getattr(step.f, "__name__", repr(step.f))
    return getattr(step, "__name__", type(step).__name__)
