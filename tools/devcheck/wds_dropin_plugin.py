"""A pytest plugin that runs webdataset's own tests through shardcache, each test with a
cache directory of its own. ``WDS_DROPIN`` chooses what is put in webdataset's place:

- ``stage`` (the default): shardcache's ``tarfile_to_samples``/``tarfile_samples`` in place
  of webdataset's, and ``shardcache.stage`` in place of ``WebDataset``'s stream opener;
- ``class``: ``shardcache.WebDataset`` in place of ``wds.WebDataset`` (nothing else).

    cd <webdataset source> && pytest -p wds_dropin_plugin tests/...   (see run-webdataset-suite)
"""

from __future__ import annotations

import os

import pytest
import webdataset
import webdataset.cache
import webdataset.compat
import webdataset.tariterators

import shardcache


def _opener(handler=webdataset.reraise_exception, **_ignored):  # WebDataset's StreamingOpen
    return shardcache.stage(handler)


def pytest_configure(config: pytest.Config) -> None:
    mode = os.environ.get("WDS_DROPIN", "stage")
    if mode == "stage":
        for module in (webdataset, webdataset.tariterators):
            module.tarfile_to_samples = shardcache.tarfile_to_samples
            module.tarfile_samples = shardcache.tarfile_samples
        webdataset.cache.StreamingOpen = _opener
    elif mode == "class":
        # shardcache.WebDataset subclasses the original: import it (by the attribute access)
        # before the name is replaced.
        for module in (webdataset, webdataset.compat):
            module.WebDataset = shardcache.WebDataset
    else:
        raise pytest.UsageError(f"WDS_DROPIN={mode!r}: expected 'stage' or 'class'")


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARDCACHE_DIR", str(tmp_path_factory.mktemp("shardcache")))
