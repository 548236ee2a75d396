"""Compressed shards read through the cache: ``shardcache.stage()`` in a webdataset pipeline and
``shardcache.WebDataset``, from local files and from a moto server. A good ``.tar.gz`` reads as
webdataset reads it; a truncated or damaged one is a ``ShardFormatError`` naming the shard."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds

import shardcache
from shardcache import ShardCache, ShardFormatError
from shardcache._ops.demo import make_shard

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:WebDataset\\(shardshuffle=:UserWarning"),
]
SHARDS = 3
PER_SHARD = 4
BUCKET = "gzshards"


def _packed(i: int) -> bytes:
    return gzip.compress(make_shard(i, PER_SHARD))


@pytest.fixture
def urls(tmp_path: Path) -> list[str]:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(SHARDS):
        (data / f"shard-{i:03d}.tar.gz").write_bytes(_packed(i))
    return [str(data / f"shard-{i:03d}.tar.gz") for i in range(SHARDS)]


def _comparable(samples: Any) -> list[tuple]:
    return [tuple(sorted((k, v) for k, v in s.items() if k != "__local_path__")) for s in samples]


def _staged(urls: list[str], cache: ShardCache, handler=wds.reraise_exception) -> wds.DataPipeline:
    """``stage()``, then webdataset's own tar reader (``wds.tarfile_to_samples()`` without
    its opener)."""

    def webdatasets_tar_reader(opened: Any) -> Any:
        files = wds.tariterators.tar_file_expander(opened, handler=handler)
        return wds.tariterators.group_by_keys(files, handler=handler)

    return wds.DataPipeline(
        wds.SimpleShardList(urls), shardcache.stage(handler, cache=cache), webdatasets_tar_reader
    )


def _damage(path: str, how: str) -> None:
    data = bytearray(Path(path).read_bytes())
    if how == "truncated":
        data = data[: len(data) * 2 // 3]
    else:  # a flipped byte in the compressed data
        data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def test_good_compressed_shards_read_as_webdataset_reads_them(
    urls: list[str], tmp_path: Path
) -> None:
    expected = _comparable(wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples()))
    assert len(expected) == SHARDS * PER_SHARD
    staged = _staged(urls, ShardCache(tmp_path / "cache-stage"))
    assert _comparable(staged) == expected
    dropin = shardcache.WebDataset(urls, shardshuffle=False, cache=ShardCache(tmp_path / "cd"))
    assert _comparable(dropin) == _comparable(wds.WebDataset(urls, shardshuffle=False))


@pytest.mark.parametrize("how", ["truncated", "flipped"])
@pytest.mark.parametrize("path", ["stage", "dropin"])
def test_a_damaged_compressed_shard_is_a_shard_format_error_naming_it(
    urls: list[str], tmp_path: Path, how: str, path: str
) -> None:
    _damage(urls[1], how)
    cache = ShardCache(tmp_path / "cache")
    if path == "stage":
        dataset: Any = _staged(urls, cache)
    else:
        dataset = shardcache.WebDataset(urls, shardshuffle=False, cache=cache)
    with pytest.raises(ShardFormatError) as caught:
        list(dataset)
    assert str(caught.value).startswith(urls[1]), caught.value
    assert "re-create or re-upload" in str(caught.value)
    try:  # webdataset: a raw zlib.error, EOFError or ReadError, or no error at all
        list(wds.WebDataset(urls, shardshuffle=False))
    except Exception as exn:  # any error but shardcache's
        assert not isinstance(exn, ShardFormatError)


@pytest.mark.parametrize("path", ["stage", "dropin"])
def test_warn_and_continue_skips_a_truncated_compressed_shard(
    urls: list[str], tmp_path: Path, path: str
) -> None:
    _damage(urls[0], "truncated")
    cache = ShardCache(tmp_path / "cache")
    handler = wds.warn_and_continue
    if path == "stage":
        dataset: Any = _staged(urls, cache, handler)
    else:
        dataset = shardcache.WebDataset(urls, shardshuffle=False, cache=cache, handler=handler)
    with pytest.warns(UserWarning, match="ShardFormatError"):
        got = _comparable(dataset)
    whole = tmp_path / "whole.tar.gz"
    whole.write_bytes(_packed(0))
    before = _comparable(wds.WebDataset(str(whole), shardshuffle=False))
    damaged = [s for s in got if dict(s)["__url__"] == urls[0]]
    assert len(damaged) < PER_SHARD  # the samples before the cut, then the shard skipped
    assert [s[:1] + s[2:] for s in damaged] == [s[:1] + s[2:] for s in before[: len(damaged)]]
    assert got[len(damaged) :] == _comparable(wds.WebDataset(urls[1:], shardshuffle=False))


def test_a_truncated_tar_gz_on_s3_is_a_shard_format_error_naming_its_url(
    s3: Any, tmp_path: Path
) -> None:
    objects = {f"train-{i:06d}.tar.gz": _packed(i) for i in range(SHARDS)}
    objects["train-000001.tar.gz"] = objects["train-000001.tar.gz"][:-9]  # the CRC cut off
    s3.put_objects(BUCKET, objects)
    (tmp_path / "cache").mkdir()
    spec = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar.gz"
    dataset = shardcache.WebDataset(spec, shardshuffle=False, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ShardFormatError) as caught:
        list(dataset)
    message = str(caught.value)
    assert message.startswith(f"s3://{BUCKET}/train-000001.tar.gz: "), message
    assert "it is truncated" in message and "re-create or re-upload" in message
