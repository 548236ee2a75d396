"""shardcache: fast, safe streaming of sharded training data from S3 (any fsspec URL).

A per-rank (or per-node) local cache in front of remote storage: every shard is published
atomically and verified, processes coordinate through stale-lock-aware locks, and
configuration comes from arguments, ``SHARDCACHE_*`` variables or the launcher (SLURM,
torchrun).

>>> from shardcache import ShardCache, expand_urls
>>> cache = ShardCache()
>>> for url in expand_urls("s3://bucket/train-{000000..000009}.tar"):
...     path = cache.fetch(url)
"""

__version__ = "0.1.0"  # the one place: pyproject.toml reads it

from importlib import import_module as _import_module

from ._base import extras as _extras
from ._base.errors import (
    CacheDirError,
    CacheError,
    CacheFullError,
    ConfigError,
    DatasetChangedError,
    DeliveryMismatchError,
    FetchError,
    IndexExchangeError,
    IntegrityError,
    LockFileError,
    LockTimeout,
    MetricsError,
    MissingExtraError,
    PeerFetchError,
    PermanentFetchError,
    PipeCommandError,
    RemoteIsADirectoryError,
    RemoteNotFoundError,
    RemotePermissionError,
    ResumeError,
    SampleIndexError,
    ShardCacheError,
    ShardFormatError,
    StallError,
    TransientFetchError,
    UnverifiableError,
    UrlError,
    WaitTimeout,
)
from ._base.redact import RedactingFilter
from ._cache.shard_cache import CacheStats, ShardCache
from ._config.settings import Settings
from ._datasets.resume_state import job_state
from ._datasets.urls import expand_urls
from ._observe.loader_report import log_epoch_summary
from ._observe.metrics import add_metrics_sink
from ._observe.prometheus import PrometheusSink  # imports prometheus_client only when made
from ._observe.tensorboard import TensorBoardSink  # imports nothing of TensorBoard
from ._prefetch.prefetcher import PrefetchedShard, Prefetcher
from ._store.eviction import CacheEntry, EvictReport

# The WebDataset integration imports webdataset, which imports torch if installed (over a
# second): load it on first use only. It works without torch, as webdataset does.
_WDS_NAMES = ("split_by_node", "stage", "tarfile_samples", "tarfile_to_samples")
# Classes built on torch.utils.data, loaded on first use. Without the torch extra their
# names import as stand-ins that raise MissingExtraError when used.
_TORCH_CLASSES = {
    "ResumableDataset": "_datasets.resumable",
    "MixtureDataset": "_datasets.mixture",
    "Source": "_datasets.mixture",
    "Step": "_datasets.mixture_schedule",
}
_stand_ins: dict[str, type] = {}


def __getattr__(name: str) -> object:
    if name in _WDS_NAMES:
        from ._datasets import wds

        return getattr(wds, name)
    if name in _TORCH_CLASSES:
        error = _extras.missing_extras(f"shardcache.{name}", "torch")
        if error is not None:
            return _stand_ins.setdefault(name, _extras.stand_in(name, error))
        found = getattr(_import_module(f".{_TORCH_CLASSES[name]}", __name__), name)
        found.__module__ = __name__
        return found
    if name == "WebDataset":
        from ._datasets.webdataset import WebDataset

        WebDataset.__module__ = __name__
        return WebDataset
    raise AttributeError(f"module 'shardcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the public ones loaded on first use (``dir(shardcache)``,
    tab completion)."""
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "CacheDirError",
    "CacheEntry",
    "CacheError",
    "CacheFullError",
    "CacheStats",
    "ConfigError",
    "DatasetChangedError",
    "DeliveryMismatchError",
    "EvictReport",
    "FetchError",
    "IndexExchangeError",
    "IntegrityError",
    "LockFileError",
    "LockTimeout",
    "MetricsError",
    "MissingExtraError",
    "MixtureDataset",
    "PeerFetchError",
    "PermanentFetchError",
    "PipeCommandError",
    "PrefetchedShard",
    "Prefetcher",
    "PrometheusSink",
    "RedactingFilter",
    "RemoteIsADirectoryError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "ResumableDataset",
    "ResumeError",
    "SampleIndexError",
    "Settings",
    "ShardCache",
    "ShardCacheError",
    "ShardFormatError",
    "Source",
    "StallError",
    "Step",
    "TensorBoardSink",
    "TransientFetchError",
    "UnverifiableError",
    "UrlError",
    "WaitTimeout",
    "WebDataset",
    "add_metrics_sink",
    "expand_urls",
    "job_state",
    "log_epoch_summary",
    "split_by_node",
    "stage",
    "tarfile_samples",
    "tarfile_to_samples",
]

# Public classes are documented as ``shardcache.X``: so they appear in tracebacks and reprs,
# and pickle by that name, whichever private module defines them.
for _name in __all__:
    _public = globals().get(_name)
    if isinstance(_public, type):
        _public.__module__ = __name__
del _name, _public
