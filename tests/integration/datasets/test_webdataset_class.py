"""``shardcache.WebDataset``: webdataset's ``WebDataset`` (signature, samples, fluent methods,
loaders) with every shard read through shardcache's cache."""

from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import pickle
import subprocess
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import webdataset as wds
import webdataset.compat
from processes import job_env
from threads import PrefetchThreads

import shardcache
from shardcache import ConfigError, ShardCache, ShardCacheError, ShardFormatError, UrlError
from shardcache._datasets.wds import TarfileToSamples
from shardcache._ops.demo import make_shard

pytestmark = [
    pytest.mark.timeout(120),
    # webdataset's own warnings (shardshuffle=None, obsolete specs) are alike in both.
    pytest.mark.filterwarnings("ignore:WebDataset\\(shardshuffle=:UserWarning"),
]
SHARDS = 4
PER_SHARD = 5
BUCKET = "wdsclass"
LOGGER = "shardcache._datasets.webdataset"


@pytest.fixture
def urls(tmp_path: Path) -> list[str]:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(SHARDS):
        (data / f"shard-{i:03d}.tar").write_bytes(make_shard(i, PER_SHARD))
    return [str(data / f"shard-{i:03d}.tar") for i in range(SHARDS)]


@pytest.fixture
def cache(tmp_path: Path) -> ShardCache:
    return ShardCache(tmp_path / "cache")


def _all_keys() -> list[str]:
    return sorted(f"{s:06d}_{i:04d}" for s in range(SHARDS) for i in range(PER_SHARD))


def _comparable(samples: Iterable[dict[str, Any]]) -> list[tuple]:
    """Each sample's key and members with their bytes; ``__local_path__`` names the cached
    copy in ours and the source in webdataset's, by design."""
    return [tuple(sorted((k, v) for k, v in s.items() if k != "__local_path__")) for s in samples]


def _both(urls: Any, cache: ShardCache, **kw: Any) -> tuple[wds.WebDataset, wds.WebDataset]:
    return shardcache.WebDataset(urls, cache=cache, **kw), wds.WebDataset(urls, **kw)


# -- the class ------------------------------------------------------------------------


def test_signature_is_webdatasets_then_the_cache_options_keyword_only() -> None:
    ours = inspect.signature(shardcache.WebDataset).parameters
    theirs = inspect.signature(wds.WebDataset).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == list(theirs)
    for name in positional:
        assert theirs[name].kind is theirs[name].POSITIONAL_OR_KEYWORD
        assert ours[name].default is theirs[name].default or (
            ours[name].default == theirs[name].default
        ), name
    keyword_only = [n for n, p in ours.items() if p.kind is p.KEYWORD_ONLY]
    stage = inspect.signature(shardcache.tarfile_to_samples).parameters
    assert keyword_only == [n for n, p in stage.items() if p.kind is p.KEYWORD_ONLY]
    assert all(ours[n].default is None for n in keyword_only)


def test_is_a_webdataset_whose_fluent_methods_keep_the_class(
    urls: list[str], cache: ShardCache
) -> None:
    ds = shardcache.WebDataset(urls, shardshuffle=False, cache=cache)
    assert isinstance(ds, wds.WebDataset)
    assert shardcache.WebDataset.__module__ == "shardcache"
    fluent = [n for n in vars(wds.compat.FluidInterface) if not n.startswith("_")]
    assert {"shuffle", "decode", "to_tuple", "batched", "map", "select"} <= set(fluent)
    assert all(callable(getattr(ds, n)) for n in fluent)
    assert type(ds.shuffle(10).decode().to_tuple("npy", "cls")) is shardcache.WebDataset
    # webdataset's opener, expander and grouper are one shardcache stage.
    readers = [s for s in ds.pipeline if isinstance(s, TarfileToSamples)]
    assert len(readers) == 1 and readers[0].cache is cache
    assert not [s for s in ds.pipeline if isinstance(s, wds.cache.StreamingOpen)]


# -- the same samples as webdataset's --------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"shardshuffle": False},
        {"shardshuffle": 3, "seed": 5},
        {"shardshuffle": 3, "detshuffle": True, "seed": 7},
        {"shardshuffle": False, "workersplitter": None, "nodesplitter": None},
    ],
    ids=["in-order", "seeded", "detshuffle", "no-splitters"],
)
def test_same_samples_in_the_same_order_as_webdataset(
    urls: list[str], cache: ShardCache, options: dict[str, Any]
) -> None:
    ours, theirs = _both(urls, cache, **options)
    for _epoch in range(2):  # detshuffle: a new order per epoch, the same in both
        got = _comparable(ours)
        assert got == _comparable(theirs)
        assert sorted(dict(s)["__key__"] for s in got) == _all_keys()


def test_resampled_with_epoch_gives_equal_epochs_of_webdatasets_samples(
    urls: list[str], cache: ShardCache
) -> None:
    ours, theirs = _both(urls, cache, resampled=True)
    for ds in (ours, theirs):  # webdataset draws from pid and time unless deterministic
        ds.pipeline[0].deterministic = True
        ds.with_epoch(13)
    for _epoch in range(2):
        got = _comparable(ours)
        assert len(got) == 13
        assert got == _comparable(theirs)


def test_select_and_rename_files(urls: list[str], cache: ShardCache) -> None:
    def select(name: str) -> bool:  # webdataset renames first, then selects
        return name.endswith(".label")

    def rename(name: str) -> str:
        return name.replace(".cls", ".label")

    ours, theirs = _both(urls, cache, shardshuffle=False, select_files=select, rename_files=rename)
    got = _comparable(ours)
    assert got == _comparable(theirs)
    assert len(got) == SHARDS * PER_SHARD
    assert all({"label", "__key__"} <= dict(s).keys() and "npy" not in dict(s) for s in got)


def test_warn_and_continue_skips_a_damaged_shard(urls: list[str], cache: ShardCache) -> None:
    Path(urls[1]).write_bytes(b"not a tar file" * 64)
    ours, theirs = _both(urls, cache, shardshuffle=False, handler=wds.warn_and_continue)
    with pytest.warns(UserWarning):
        got = _comparable(ours)
    with pytest.warns(UserWarning):
        assert got == _comparable(theirs)
    assert len(got) == (SHARDS - 1) * PER_SHARD


def test_a_damaged_shard_raises_by_default(
    urls: list[str], cache: ShardCache, prefetch_threads: PrefetchThreads
) -> None:
    Path(urls[1]).write_bytes(b"not a tar file" * 64)
    with pytest.raises(ShardFormatError, match=r"shard-001\.tar: the shard starts") as ours:
        list(shardcache.WebDataset(urls, shardshuffle=False, cache=cache))
    # The error (raised by webdataset's tar expansion, after our stage) stopped the
    # prefetcher, although its traceback, still held here, holds the stage's generator.
    prefetch_threads.assert_ended()
    with pytest.raises(Exception) as theirs:
        list(wds.WebDataset(urls, shardshuffle=False))
    # webdataset: tarfile.ReadError, its message the stream's repr; ours names the shard.
    assert type(theirs.value) is tarfile.ReadError
    assert "re-create or re-upload" in str(ours.value)


@pytest.mark.parametrize("form", ["dict", "yaml"])
def test_multi_shard_specs(
    urls: list[str], cache: ShardCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    monkeypatch.setenv("ALLOW_OBSOLETE", "1")  # webdataset 1.0.2 marks MultiShardSample so
    spec: Any = {"datasets": [{"name": "a", "shards": urls[:2]}, {"shards": urls[2:]}]}
    if form == "yaml":
        (tmp_path / "spec.yaml").write_text(
            "datasets:\n" + "".join(f"  - shards: {u}\n" for u in urls)
        )
        spec = str(tmp_path / "spec.yaml")
    ours, theirs = _both(spec, cache, shardshuffle=False)
    assert sorted(_comparable(ours)) == sorted(_comparable(theirs))
    assert len(_comparable(ours)) == SHARDS * PER_SHARD


def test_empty_check_and_repeat(urls: list[str], cache: ShardCache, tmp_path: Path) -> None:
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w"):
        pass
    for cls in (shardcache.WebDataset, wds.WebDataset):
        kw = {"cache": cache} if cls is shardcache.WebDataset else {}
        with pytest.raises(ValueError, match="No samples found"):
            list(cls([str(empty)], shardshuffle=False, **kw))
        assert list(cls([str(empty)], shardshuffle=False, empty_check=False, **kw)) == []
    twice = shardcache.WebDataset(urls, shardshuffle=False, cache=cache).repeat(2)
    assert len(list(twice)) == 2 * SHARDS * PER_SHARD


def test_fluent_chain_shuffle_decode_to_tuple_batched(urls: list[str], cache: ShardCache) -> None:
    ds = (
        shardcache.WebDataset(urls, shardshuffle=2, cache=cache, seed=1)
        .shuffle(100)
        .decode()
        .to_tuple("__key__", "npy", "cls")
    )
    samples = list(ds)
    assert sorted(k for k, _, _ in samples) == _all_keys()
    assert all(a.shape == (64, 64, 3) and isinstance(c, int) for _, a, c in samples)
    batches = list(ds.batched(8))
    assert [len(b[0]) for b in batches] == [8, 8, 4]
    assert batches[0][1].shape == (8, 64, 64, 3)


def test_close_and_context_manager_stop_the_prefetchers(
    urls: list[str], cache: ShardCache, prefetch_threads: PrefetchThreads
) -> None:
    with shardcache.WebDataset(urls, shardshuffle=False, cache=cache) as ds:
        it = iter(ds)
        next(it)
    prefetch_threads.assert_ended()


# -- loaders ----------------------------------------------------------------------------


def test_webloader_with_two_worker_processes(urls: list[str], cache: ShardCache) -> None:
    ds = shardcache.WebDataset(urls, shardshuffle=False, cache=cache).to_tuple("__key__", "cls")
    loader = wds.WebLoader(ds, batch_size=None, num_workers=2, timeout=60)
    for _epoch in range(2):
        assert sorted(k for k, _ in loader) == _all_keys()  # every sample once per epoch
    assert all(cache.contains(u) for u in urls)  # fetched into the cache by the workers


def test_dataloader_spawned_workers_unpickle_the_class_by_its_public_name(
    urls: list[str], cache: ShardCache
) -> None:
    ds = shardcache.WebDataset(urls, shardshuffle=False, cache=cache).to_tuple("__key__")
    assert type(pickle.loads(pickle.dumps(ds))) is shardcache.WebDataset
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context=mp.get_context("spawn")
    )
    assert sorted(k for batch in loader for k in batch[0]) == _all_keys()


# -- S3 and the cache ------------------------------------------------------------------


def test_second_iteration_over_s3_makes_no_get(s3, tmp_path: Path) -> None:
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": make_shard(i, PER_SHARD) for i in range(SHARDS)})
    (tmp_path / "cache").mkdir()
    ds = shardcache.WebDataset(
        f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar",
        shardshuffle=False,
        cache_dir=str(tmp_path / "cache"),
    ).to_tuple("__key__", "npy")
    first = list(ds)
    gets = len(s3.requests("GET"))
    assert s3.count("GET", BUCKET) >= SHARDS
    assert list(ds) == first
    assert len(s3.requests("GET")) == gets, "the second iteration sent GETs"
    assert sorted(k for k, _ in first) == _all_keys()


def test_cache_dir_and_cache_size_map_to_a_shardcache_logged_once(
    urls: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "wdscache"
    root.mkdir()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ds = shardcache.WebDataset(urls, shardshuffle=False, cache_dir=str(root), cache_size=10**9)
        assert len(list(ds)) == SHARDS * PER_SHARD
        list(ds.to_tuple("__key__"))
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert f"cache_dir={root}" in record.getMessage()
    assert "max_bytes=1000000000" in record.getMessage()
    (reader,) = [s for s in ds.pipeline if isinstance(s, TarfileToSamples)]
    assert reader.cache is not None and reader.cache.settings.max_bytes == 10**9
    assert reader.cache.settings.scope_dir == root / "rank-0"
    assert all(reader.cache.contains(u) for u in urls)


def test_wds_cache_variables_win_over_the_arguments_as_in_webdataset(
    urls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    (tmp_path / "env").mkdir()
    monkeypatch.setenv("WDS_CACHE", str(tmp_path / "env"))
    monkeypatch.setenv("WDS_CACHE_SIZE", "5000000")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ds = shardcache.WebDataset(urls, shardshuffle=False, cache_dir=str(tmp_path / "arg"))
    (reader,) = [s for s in ds.pipeline if isinstance(s, TarfileToSamples)]
    assert reader.cache.settings.scope_dir == tmp_path / "env" / "rank-0"
    assert reader.cache.settings.max_bytes == 5_000_000
    assert "WDS_CACHE=" in caplog.text
    monkeypatch.setenv("WDS_CACHE_SIZE", "lots")
    with pytest.raises(ConfigError, match="WDS_CACHE_SIZE='lots'"):
        shardcache.WebDataset(urls, shardshuffle=False)


def test_without_cache_dir_shardcaches_default_cache_is_used(
    urls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setenv("SHARDCACHE_DIR", str(tmp_path / "default"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ds = shardcache.WebDataset(urls, shardshuffle=False)
        assert len(list(ds)) == SHARDS * PER_SHARD
        zero = shardcache.WebDataset(
            urls, shardshuffle=False, cache_dir=str(tmp_path), cache_size=0
        )
    assert all(ShardCache(tmp_path / "default").contains(u) for u in urls)
    # cache_size=0 (webdataset: no cache) falls back to the default cache, and says so.
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert "cache_size=0" in record.getMessage()
    assert all(s.cache is None for s in zero.pipeline if isinstance(s, TarfileToSamples))


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "names"),
    [({"cache_dir": "."}, "cache, cache_dir"), ({"cache_size": 10}, "cache, cache_size")],
)
def test_cache_with_cache_dir_or_size_is_a_config_error_naming_both(
    urls: list[str], cache: ShardCache, given: dict[str, Any], names: str
) -> None:
    with pytest.raises(ConfigError, match=f"cache=.* and {next(iter(given))}") as caught:
        shardcache.WebDataset(urls, shardshuffle=False, cache=cache, **given)
    assert caught.value.name == names


def test_a_missing_cache_dir_is_a_value_error_as_in_webdataset(
    urls: list[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist"):
        wds.WebDataset(urls, shardshuffle=False, cache_dir=str(missing))
    with pytest.raises(ConfigError, match=r"does not exist.*mkdir -p") as caught:
        shardcache.WebDataset(urls, shardshuffle=False, cache_dir=str(missing))
    assert isinstance(caught.value, ValueError) and caught.value.name == "cache_dir"
    assert not missing.exists()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="is not a directory"):
        shardcache.WebDataset(urls, shardshuffle=False, cache_dir=str(tmp_path / "file"))


def test_wrong_types_and_values_fail_at_construction(urls: list[str], cache: ShardCache) -> None:
    with pytest.raises(TypeError, match="the cache is a keyword argument"):
        shardcache.WebDataset(urls, cache)
    with pytest.raises(TypeError, match="select_files must be"):
        shardcache.WebDataset(urls, shardshuffle=False, select_files="*.cls")
    with pytest.raises(ConfigError, match="threads"):
        shardcache.WebDataset(urls, shardshuffle=False, threads=0)
    with pytest.raises(ConfigError, match="cache_size"):
        shardcache.WebDataset(urls, shardshuffle=False, cache_dir=".", cache_size="1G")


def test_a_directory_url_is_refused(urls: list[str], cache: ShardCache) -> None:
    directory = str(Path(urls[0]).parent) + "/"
    with pytest.raises(UrlError, match="directory URL"):
        shardcache.WebDataset(directory, cache=cache)
    assert sorted(p.name for p in Path(directory).iterdir()) == [Path(u).name for u in urls]


def test_another_webdataset_layout_fails_with_what_was_found(
    urls: list[str], cache: ShardCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    def expander(data, **kw):  # stands in for a webdataset that reads tars otherwise
        return wds.tariterators.tar_file_expander(data, **kw)

    monkeypatch.setattr(webdataset.compat, "tar_file_expander", expander)
    with pytest.raises(ShardCacheError, match=r"cannot find the stages.*'expander'") as caught:
        shardcache.WebDataset(urls, shardshuffle=False, cache=cache)
    assert "group_by_keys" in caught.value.stages


# -- ranks under plain srun ----------------------------------------------------------------

_SRUN_RANK = """
import sys, webdataset as wds, shardcache
urls, splitter = sys.argv[1].split(","), sys.argv[2]
cache = shardcache.ShardCache(sys.argv[3])
extra = {} if splitter == "default" else {"nodesplitter": wds.split_by_node}
ds = shardcache.WebDataset(urls, shardshuffle=False, cache=cache, **extra)
try:
    print(" ".join(s["__key__"] for s in ds))
except ValueError as exn:
    print(type(exn).__name__, exn)
"""


def _srun_ranks(urls: list[str], splitter: str, tmp_path: Path, ranks: int) -> list[str]:
    """What each of ``ranks`` processes launched as plain ``srun`` launches them (SLURM's
    variables, no torch.distributed, no RANK/WORLD_SIZE) prints."""
    env = job_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SRUN_RANK, ",".join(urls), splitter, str(tmp_path / f"c{r}")],
            env={**env, "SLURM_PROCID": str(r), "SLURM_NTASKS": str(ranks), "SLURM_JOB_ID": "7"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    outputs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0] * ranks, [err for _, err in outputs]
    return [out.strip() for out, _ in outputs]


def test_webdatasets_split_by_node_splits_by_slurm_rank_under_plain_srun(
    urls: list[str], tmp_path: Path
) -> None:
    # webdataset's own split_by_node sees one rank here: every rank would read every shard.
    parts = [p.split() for p in _srun_ranks(urls, "split_by_node", tmp_path, 2)]
    assert parts[0] == [f"{s:06d}_{i:04d}" for s in (0, 2) for i in range(PER_SHARD)]
    assert sorted(parts[0] + parts[1]) == _all_keys()


def test_the_default_splitter_refuses_several_slurm_ranks_naming_the_fix(
    urls: list[str], tmp_path: Path
) -> None:
    for said in _srun_ranks(urls, "default", tmp_path, 2):
        assert said.startswith("ConfigError "), said
        assert "from slurm" in said and "nodesplitter=shardcache.split_by_node" in said
