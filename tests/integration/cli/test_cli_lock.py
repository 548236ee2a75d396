"""``shardcache lock``: write a dataset lockfile of a shard list on moto (what the cache
holds read from its records, the rest asked with HEAD) and diff the shards against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tars import shard_samples, tar_bytes

from shardcache import ShardCache
from shardcache._cli.main import main
from shardcache._datasets.dataset_lock import read_lock

BUCKET = "cli-lock"
SHARDS = 10
SPEC = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
URLS = [f"s3://{BUCKET}/train-{i:06d}.tar" for i in range(SHARDS)]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def shards(s3) -> dict[int, bytes]:
    client = s3.boto3_client()
    client.create_bucket(Bucket=BUCKET)
    client.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    data = {i: tar_bytes(shard_samples(i, 3)) for i in range(SHARDS)}
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": body for i, body in data.items()})
    return data


def test_lock_writes_every_shards_identity_the_cache_held_ones_without_a_request(
    s3, shards, tmp_path: Path, capsys
) -> None:
    cache_dir = tmp_path / "cache"
    for url in URLS[:4]:
        ShardCache(cache_dir).fetch(url)
    s3.clear_requests()
    lock = tmp_path / "dataset.lock.json"
    code, out, _ = _cli(
        capsys, "lock", SPEC, "-o", str(lock), "--cache-dir", str(cache_dir), "--json"
    )
    assert code == 0
    summary = json.loads(out)
    assert (summary["shards"], summary["from_cache"], summary["requests"]) == (SHARDS, 4, 6)
    assert s3.count("HEAD", BUCKET) == 6 and s3.count("GET", BUCKET) == 0
    written = read_lock(str(lock))
    assert written is not None and list(written.shards) == URLS
    assert summary["digest"] == written.digest
    client = s3.boto3_client()
    for url in URLS:
        head = client.head_object(Bucket=BUCKET, Key=url.rsplit("/", 1)[1])
        entry = written.shards[url]
        assert (entry.size, entry.etag, entry.version_id) == (
            head["ContentLength"],
            head["ETag"].strip('"'),
            head["VersionId"],
        )


def test_diff_exits_0_when_nothing_changed_and_1_naming_each_changed_shard(
    s3, shards, tmp_path: Path, capsys
) -> None:
    lock = tmp_path / "dataset.lock.json"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert _cli(capsys, "lock", SPEC, "-o", str(lock), *cache)[0] == 0
    code, out, _ = _cli(capsys, "lock", "--diff", str(lock), *cache)
    assert (code, out) == (0, f"all {SHARDS} shards match {lock}\n")
    s3.put_objects(
        BUCKET, {f"train-{i:06d}.tar": tar_bytes(shard_samples(i + 50, 3)) for i in (2, 7)}
    )
    code, out, _ = _cli(capsys, "lock", "--diff", str(lock), *cache)
    assert code == 1
    assert out.startswith(f"2 of {SHARDS} shards differ from {lock}:\n")
    named = [line.split(": ", 1)[0].strip() for line in out.splitlines()[1:]]
    assert named == [URLS[2], URLS[7]]
    assert "expected" in out and "etag" in out
    code, out, _ = _cli(capsys, "lock", "--diff", str(lock), *cache, "--json")
    report = json.loads(out)
    assert code == 1 and [c["url"] for c in report["changed"]] == [URLS[2], URLS[7]]
    assert (
        report["changed"][0]["expected"]["version_id"] != report["changed"][0]["seen"]["version_id"]
    )
    # A spec with a shard the lock does not hold: that one is named too.
    wider = f"s3://{BUCKET}/train-{{000000..{SHARDS:06d}}}.tar"
    s3.put_objects(BUCKET, {f"train-{SHARDS:06d}.tar": shards[0]})
    code, out, _ = _cli(capsys, "lock", "--diff", str(lock), wider, *cache)
    assert code == 1 and f"s3://{BUCKET}/train-{SHARDS:06d}.tar: not in the lock" in out


def test_diff_of_a_missing_or_foreign_file_is_a_usage_error(
    s3, shards, tmp_path: Path, capsys
) -> None:
    code, _, err = _cli(capsys, "lock", "--diff", str(tmp_path / "none.json"))
    assert code == 2 and "no such lock file" in err
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"format": "shardcache.samples"}))
    code, _, err = _cli(capsys, "lock", "--diff", str(foreign))
    assert code == 2 and "is not a shardcache dataset lock" in err
    with pytest.raises(SystemExit) as exited:  # neither -o nor --diff
        main(["lock", SPEC])
    assert exited.value.code == 2
    assert "one of the arguments -o/--output --diff is required" in capsys.readouterr().err
