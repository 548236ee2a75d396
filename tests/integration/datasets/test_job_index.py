"""A ResumableDataset's learned sample index over the moto S3 server, in one process (no
process group: this cache learns every shard): kept in the cache root and reused, kept
beside the data when allowed and found there by new caches, a damaged kept index learned
again, an index missing a left-out shard not kept. (Sharing the work between ranks:
tests/system/test_ddp_epochs.py.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import webdataset as wds
from tars import shard_samples, tar_bytes

from shardcache import ConfigError, ResumableDataset, ShardCache

BUCKET = "job-index"
SHARDS = 4
SPEC = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
TARS = {f"train-{i:06d}.tar": tar_bytes(shard_samples(i, 5 + i)) for i in range(SHARDS)}
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shards_s3(s3):
    s3.put_objects(BUCKET, TARS)
    s3.clear_requests()
    return s3


def dataset(cache: Path, **options) -> ResumableDataset:
    return ResumableDataset(SPEC, cache=ShardCache(cache), threads=2, **options)


def shard_gets(s3) -> int:
    return sum(1 for r in s3.requests("GET", f"/{BUCKET}/") if r.key in TARS)


def learned_records(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/.samples/*/*.json"))


def kept(cache: Path) -> list[Path]:
    return sorted((cache / ".indexes").glob("*.json"))


def test_the_learned_index_is_kept_in_the_cache_root_and_reused(
    shards_s3, tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="shardcache")
    first = dataset(tmp_path / "cache").prepare()
    assert shard_gets(shards_s3) == SHARDS
    assert len(kept(tmp_path / "cache")) == 1
    assert "learning the sample offsets of all 4 shards through the cache" in caplog.text
    assert "init_process_group" not in caplog.text  # one rank: nobody to share with
    assert f"the sample index: kept at {kept(tmp_path / 'cache')[0]} for the next job" in (
        caplog.text
    )

    for record in learned_records(tmp_path / "cache"):
        record.unlink()
    caplog.clear()
    second = dataset(tmp_path / "cache").prepare()
    assert f"sample offsets of 4 shards: the index kept at {kept(tmp_path / 'cache')[0]}" in (
        caplog.text
    )
    assert not learned_records(tmp_path / "cache")  # nothing scanned again
    assert second._epoch_split().counts == first._epoch_split().counts == [5, 6, 7, 8]


def test_ranks_without_a_process_group_each_learn_everything_and_are_told_why(
    shards_s3, tmp_path: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="shardcache")
    dataset(tmp_path / "cache", rank=0, world_size=2).prepare()
    assert shard_gets(shards_s3) == SHARDS
    assert "no torch.distributed process group in this process shares the work" in caplog.text


def test_an_index_kept_beside_the_data_serves_new_caches(shards_s3, tmp_path: Path) -> None:
    dataset(tmp_path / "a", keep_index="data").prepare()
    keys = [o["Key"] for o in shards_s3.boto3_client().list_objects_v2(Bucket=BUCKET)["Contents"]]
    beside = [key for key in keys if key not in TARS]
    assert len(beside) == 1 and beside[0].startswith(".shardcache-index-"), keys

    shards_s3.clear_requests()
    found = dataset(tmp_path / "b", keep_index="data").prepare()
    assert shard_gets(shards_s3) == 0  # nothing fetched to learn
    assert found._epoch_split().counts == [5, 6, 7, 8]
    assert len(kept(tmp_path / "b")) == 0  # read beside the data: nothing learned to keep
    # Without the opt-in the data is not looked at: this cache learns (and keeps) its own.
    dataset(tmp_path / "c").prepare()
    assert shard_gets(shards_s3) == SHARDS
    assert len(kept(tmp_path / "c")) == 1


def test_a_damaged_kept_index_is_learned_again(shards_s3, tmp_path: Path, caplog) -> None:
    dataset(tmp_path / "cache").prepare()
    (path,) = kept(tmp_path / "cache")
    path.write_text('{"format": "shardcache.samples", "version": 1, "shards": [{"url": 1}]}')
    caplog.set_level(logging.INFO, logger="shardcache")
    again = dataset(tmp_path / "cache").prepare()
    assert "the kept sample index is not used" in caplog.text
    assert again._epoch_split().counts == [5, 6, 7, 8]
    assert kept(tmp_path / "cache") == [path] and '"starts"' in path.read_text()


def test_an_index_missing_a_left_out_shard_is_not_kept(shards_s3, tmp_path: Path, caplog) -> None:
    shards_s3.boto3_client().delete_object(Bucket=BUCKET, Key="train-000002.tar")
    caplog.set_level(logging.INFO, logger="shardcache")
    ds = dataset(tmp_path / "cache", handler=wds.warn_and_continue).prepare()
    assert ds._epoch_split().counts == [5, 6, 0, 8]
    assert kept(tmp_path / "cache") == []
    assert "the sample index: not kept: 1 shards were left out (first: s3://" in caplog.text


def test_keep_index_is_checked() -> None:
    with pytest.raises(ConfigError, match="keep_index must be one of"):
        ResumableDataset(SPEC, keep_index="bucket")
