"""The public surface named in the issue is the contract."""

from __future__ import annotations

import pickle

import shardcache
from shardcache._base import errors


def test_public_names() -> None:
    for name in ("ShardCache", "expand_urls", "ShardCacheError", "LockTimeout", "FetchError"):
        assert name in shardcache.__all__
    assert sorted(shardcache.__all__) == shardcache.__all__
    for name in shardcache.__all__:
        assert getattr(shardcache, name) is not None
    for method in ("fetch", "open", "path_for", "contains", "stats", "from_env"):
        assert callable(getattr(shardcache.ShardCache, method))


def test_every_error_is_a_shardcache_error_and_pickles_with_its_facts() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ShardCacheError)
        exc = cls("something went wrong at s3://b/k", url="s3://b/k", attempts=3)
        clone = pickle.loads(pickle.dumps(exc))
        assert type(clone) is cls and str(clone) == str(exc)
        assert (clone.url, clone.attempts) == ("s3://b/k", 3)


def test_builtin_bases_let_generic_handlers_catch() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.RemoteNotFoundError, FileNotFoundError)
    assert issubclass(errors.LockTimeout, TimeoutError)
    assert issubclass(errors.StallError, TimeoutError)
    assert issubclass(errors.CacheFullError, OSError)
    # Every failure to open a shard is an IOError in webdataset: so through the drop-in.
    for fetch_error in (errors.TransientFetchError, errors.PermanentFetchError):
        assert issubclass(fetch_error, OSError)
    assert issubclass(errors.PipeCommandError, OSError)


def test_dir_lists_the_names_loaded_on_first_use() -> None:
    names = dir(shardcache)
    assert set(shardcache.__all__) <= set(names)
    for lazy in ("ResumableDataset", "MixtureDataset", "WebDataset", "split_by_node", "Step"):
        assert lazy in names
    assert names == sorted(names)
