"""A pytest plugin that runs webdataset's own tests with shardcache's drop-in in place of
webdataset's ``tarfile_to_samples``/``tarfile_samples`` and of ``WebDataset``'s stream
opener, each test with a cache directory of its own.

    cd <webdataset source> && pytest -p wds_dropin_plugin tests/...   (see run-webdataset-suite)
"""

from __future__ import annotations

import pytest
import webdataset
import webdataset.cache
import webdataset.tariterators

import shardcache


def _opener(handler=webdataset.reraise_exception, **_ignored):  # WebDataset's StreamingOpen
    return shardcache.stage(handler)


def pytest_configure(config: pytest.Config) -> None:
    for module in (webdataset, webdataset.tariterators):
        module.tarfile_to_samples = shardcache.tarfile_to_samples
        module.tarfile_samples = shardcache.tarfile_samples
    webdataset.cache.StreamingOpen = _opener


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARDCACHE_DIR", str(tmp_path_factory.mktemp("shardcache")))
