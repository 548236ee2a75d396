"""The dataset lockfile over a moto S3 server, with bucket versioning on and off: 10 % of
the shards rewritten between a checkpoint and the resume; the recorded versions read back
(the same samples as a run without the interruption), or every changed shard named."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from tars import shard_samples, tar_bytes

from shardcache import (
    DatasetChangedError,
    PermanentFetchError,
    ResumableDataset,
    ResumeError,
    ShardCache,
)
from shardcache._datasets.dataset_lock import ShardIdentity, cached_identity, identities, read_lock

BUCKET = "locked"
SHARDS = 20
PER_SHARD = 7
REWRITTEN = (3, 11)  # 10 % of the shards
SPEC = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
URLS = [f"s3://{BUCKET}/train-{i:06d}.tar" for i in range(SHARDS)]
pytestmark = pytest.mark.timeout(180)


def _shard(shard: int, payload: int = 0) -> bytes:
    """A shard's tar; another ``payload`` gives other bytes of the same keys and sizes."""
    return tar_bytes(
        [
            (key, {"bin": bytes([(payload * 97 + i) % 251]) * 40, "cls": files["cls"]})
            for i, (key, files) in enumerate(shard_samples(shard, PER_SHARD))
        ]
    )


def _bucket(s3, *, versioning: bool) -> None:
    client = s3.boto3_client()
    client.create_bucket(Bucket=BUCKET)
    if versioning:
        client.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": _shard(i) for i in range(SHARDS)})


def _rewrite(s3) -> None:
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": _shard(i, payload=1) for i in REWRITTEN})


def _dataset(cache_dir: Path, lock: Path | str | None, **options: Any) -> ResumableDataset:
    options = {"seed": 5, "shuffle_buffer": 4, "rank": 0, "world_size": 1, **options}
    return ResumableDataset(
        SPEC,
        cache=ShardCache(cache_dir),
        threads=2,
        lock=None if lock is None else str(lock),
        **options,
    )


def _sample(sample: dict[str, Any]) -> tuple[str, bytes]:
    return sample["__key__"], sample["bin"]


def _checkpoint(tmp_path: Path, lock: Path, at: int) -> tuple[list, dict]:
    """Every sample of epoch 0 of an uninterrupted run, and its JSON state after ``at``."""
    dataset = _dataset(tmp_path / "first", lock)
    samples, state = [], None
    for sample in dataset:
        samples.append(_sample(sample))
        if len(samples) == at:
            state = json.loads(json.dumps(dataset.state_dict()))
    assert state is not None and len(samples) == SHARDS * PER_SHARD
    return samples, state


def _resumed(cache_dir: Path, lock: Path, state: dict, **options: Any) -> list:
    dataset = _dataset(cache_dir, lock, **options)
    dataset.load_state_dict(state)
    return [_sample(sample) for sample in dataset]


def test_with_versioning_the_resume_reads_the_recorded_versions(
    s3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _bucket(s3, versioning=True)
    lock = tmp_path / "dataset.lock.json"
    at = 61
    samples, state = _checkpoint(tmp_path, lock, at)
    recorded = read_lock(str(lock))
    assert recorded is not None and state["lock"]["digest"] == recorded.digest
    assert all(recorded.shards[url].version_id for url in URLS)
    _rewrite(s3)
    # Another node, whose cache got the rewritten shards' new bytes meanwhile.
    for shard in REWRITTEN:
        ShardCache(tmp_path / "other-node").fetch(URLS[shard])
    s3.clear_requests()
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        assert _resumed(tmp_path / "other-node", lock, state) == samples[at:]
    assert any("2 shards changed since the dataset lock" in r.getMessage() for r in caplog.records)
    for shard in REWRITTEN:
        gets = s3.requests("GET", f"/{BUCKET}/train-{shard:06d}.tar")
        assert gets and all("versionId=" in r.query for r in gets), gets


def test_the_cache_keys_a_pinned_version_apart_from_the_latest(s3, tmp_path: Path) -> None:
    _bucket(s3, versioning=True)
    lock = tmp_path / "dataset.lock.json"
    _checkpoint(tmp_path, lock, 1)
    _rewrite(s3)
    url = URLS[REWRITTEN[0]]
    old = read_lock(str(lock)).shards[url].version_id  # type: ignore[union-attr]
    cache = ShardCache(tmp_path / "both")
    latest = cache.fetch(url)
    pinned = cache.fetch(f"{url}?versionId={old}")
    assert latest != pinned
    assert latest.read_bytes() == _shard(REWRITTEN[0], payload=1)
    assert pinned.read_bytes() == _shard(REWRITTEN[0])
    assert cache.fetch(url).read_bytes() == _shard(REWRITTEN[0], payload=1)


def test_without_versioning_the_resume_names_exactly_the_changed_shards(s3, tmp_path: Path) -> None:
    _bucket(s3, versioning=False)
    lock = tmp_path / "dataset.lock.json"
    _, state = _checkpoint(tmp_path, lock, 30)
    _rewrite(s3)
    with pytest.raises(DatasetChangedError) as caught:
        _resumed(tmp_path / "other-node", lock, state)
    changed = [URLS[i] for i in REWRITTEN]
    assert caught.value.changed == changed
    message = str(caught.value)
    assert f"2 of {SHARDS} shards changed since the dataset lock {lock}" in message
    for url in changed:
        assert url in message
    assert "shards_changed='warn'" in message
    others = set(URLS) - set(changed)
    assert not any(f"{url}:" in message for url in others)
    assert isinstance(caught.value, ResumeError)


def test_without_versioning_warn_reads_the_shards_as_they_are_now(
    s3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _bucket(s3, versioning=False)
    lock = tmp_path / "dataset.lock.json"
    samples, state = _checkpoint(tmp_path, lock, 30)
    _rewrite(s3)
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        rest = _resumed(tmp_path / "other-node", lock, state, shards_changed="warn")
    assert [key for key, _ in rest] == [key for key, _ in samples[30:]]
    rewritten_keys = {key for i in REWRITTEN for key, _ in shard_samples(i, PER_SHARD)}
    assert any(
        key in rewritten_keys and data != old
        for (key, data), (_, old) in zip(rest, samples[30:], strict=True)
    )
    warned = [r.getMessage() for r in caplog.records if "shards_changed='warn'" in r.getMessage()]
    assert len(warned) == 1 and all(URLS[i] in warned[0] for i in REWRITTEN)


def test_the_same_cache_records_and_checks_without_a_request(s3, tmp_path: Path) -> None:
    _bucket(s3, versioning=True)
    lock = tmp_path / "dataset.lock.json"
    dataset = _dataset(tmp_path / "cache", lock)
    s3.clear_requests()
    dataset.prepare()  # learns the offsets (one GET a shard), then records the lock
    assert s3.count("HEAD", BUCKET) == 0
    assert s3.count("GET", BUCKET) == SHARDS
    s3.clear_requests()
    _dataset(tmp_path / "cache", lock).prepare()  # checked against the cached copies
    assert s3.count(bucket=BUCKET) == 0
    s3.clear_requests()
    # A cold cache reads the recorded versions as they are: no HEAD to compare them.
    dataset = _dataset(tmp_path / "cold", lock)
    dataset.prepare()
    assert s3.count("HEAD", BUCKET) == 0
    assert all("versionId=" in r.query for r in s3.requests("GET", f"/{BUCKET}/"))
    assert len(s3.requests("GET", f"/{BUCKET}/")) == SHARDS


def test_without_versioning_a_cold_cache_asks_each_shard_once(s3, tmp_path: Path) -> None:
    _bucket(s3, versioning=False)
    lock = tmp_path / "dataset.lock.json"
    _dataset(tmp_path / "cache", lock).prepare()
    s3.clear_requests()
    _dataset(tmp_path / "cold", lock).prepare()
    assert s3.count("HEAD", BUCKET) == SHARDS


def test_a_state_under_a_lock_needs_that_lock(s3, tmp_path: Path) -> None:
    _bucket(s3, versioning=False)
    lock = tmp_path / "dataset.lock.json"
    _, state = _checkpoint(tmp_path, lock, 10)
    with pytest.raises(ResumeError, match="pass lock="):
        _dataset(tmp_path / "first", None).load_state_dict(state)
    other = tmp_path / "other.lock.json"
    other.write_text(lock.read_text().replace(f"train-{0:06d}", "train-x"))
    with pytest.raises(Exception, match="digest"):
        _dataset(tmp_path / "first", other).load_state_dict(state)
    with pytest.raises(ResumeError, match="does not exist"):
        _dataset(tmp_path / "first", tmp_path / "gone.json").load_state_dict(state)


def test_a_store_that_ignores_the_version_asked_is_never_served_as_that_version(
    seaweedfs, tmp_path: Path
) -> None:
    # SeaweedFS answers a GET of ?versionId= of an unversioned bucket with the current object.
    seaweedfs.put_objects(BUCKET, {"train-000000.tar": _shard(0)})
    cache = ShardCache(tmp_path / "cache")
    with pytest.raises(PermanentFetchError, match="answered version None for a GET of version"):
        cache.fetch(f"{URLS[0]}?versionId=recorded")
    assert not cache.contains(f"{URLS[0]}?versionId=recorded")
    assert cache.fetch(URLS[0]).read_bytes() == _shard(0)


def test_a_lockfile_in_the_bucket_is_written_once_and_read_back(s3, tmp_path: Path) -> None:
    _bucket(s3, versioning=False)
    where = f"s3://{BUCKET}-locks/dataset.lock.json"
    s3.boto3_client().create_bucket(Bucket=f"{BUCKET}-locks")
    _dataset(tmp_path / "a", where).prepare()
    written = read_lock(where)
    assert written is not None and list(written.shards) == URLS
    _rewrite(s3)
    _dataset(tmp_path / "b", where, shards_changed="warn").prepare()  # does not overwrite it
    assert read_lock(where) == written
    with pytest.raises(DatasetChangedError) as caught:
        _dataset(tmp_path / "c", where).prepare()
    assert caught.value.changed == [URLS[i] for i in REWRITTEN]


def test_copies_other_caches_hold_stand_in_for_heads_but_not_for_this_caches_own(
    s3, tmp_path: Path
) -> None:
    """What a job's ranks gave with their index records (the identities of the copies their
    caches hold) takes the place of a HEAD for a shard this cache does not hold; this
    cache's own record of a copy it holds comes first."""
    _bucket(s3, versioning=False)
    mine, theirs = ShardCache(tmp_path / "mine"), ShardCache(tmp_path / "theirs")
    for url in URLS[:10]:
        theirs.fetch(url)
    for url in URLS[10:]:
        mine.fetch(url)
    held = {url: cached_identity(theirs, url) for url in URLS[:10]}
    held[URLS[12]] = ShardIdentity(1, etag='"not-this-copy"')  # this cache holds its own
    s3.clear_requests()
    now, asked = identities(URLS, mine, threads=2, held=held)
    assert asked == 0 and s3.count("HEAD", BUCKET) == 0
    stored, heads = identities(URLS, ShardCache(tmp_path / "cold"), threads=2)
    assert heads == SHARDS and now == stored  # what HEADs give, and this cache's own copy
