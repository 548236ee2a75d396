"""The dataset lockfile under torchrun (2 ranks x 2 DataLoader workers, each writing or
reading the lock on its own, a cache each): the lock made after the ranks learned the
sample index together, one shard of ten rewritten after a checkpoint, and a resume on
another node (empty caches). The lock costs no HEAD: each cache learned half of the shards
and the ranks gave the identities of their copies with their records. With bucket
versioning the resume reads the recorded version and every rank yields exactly the batches
of the run without the interruption; without it the job stops naming the rewritten shard,
on the same caches too, where the cache holding the shard has its old copy and the kept
index the old offsets (tests/support/resume_job.py is the job)."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from processes import JOB_TIMEOUT, job_env, torchrun
from repo import SUPPORT
from tars import shard_samples, tar_bytes

BUCKET = "torchrun-lock"
SHARDS = 10
PER_SHARD = 9
REWRITTEN = 6  # one shard of ten
SPEC = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
CHECKPOINT = 7  # batches of each rank; 15 in the epoch (2 workers x 23 samples / 3)
pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 100)


def _shard(shard: int) -> bytes:
    return tar_bytes(shard_samples(shard, PER_SHARD))


def _run(s3, root: Path, cache: str, log_as: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun(
            2,
            SUPPORT / "resume_job.py",
            f"--spec={SPEC}",
            f"--cache={root / cache}",
            f"--out={root / 'out'}",
            f"--log-as={log_as}",
            "--workers=2",
            "--epochs=1",
            f"--lock={root / 'out' / 'dataset.lock.json'}",
            *extra,
        ),
        env=job_env(**s3.env()),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
        check=False,
    )


def _batches(root: Path, run: str, rank: int) -> list[list[str]]:
    lines = (root / "out" / f"keys-{run}-rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["keys"] for line in lines]


@pytest.mark.parametrize("versioning", [True, False], ids=["versioning", "no-versioning"])
def test_a_resume_after_a_shard_was_rewritten(s3, tmp_path: Path, versioning: bool) -> None:
    client = s3.boto3_client()
    client.create_bucket(Bucket=BUCKET)
    if versioning:
        client.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": _shard(i) for i in range(SHARDS)})
    (tmp_path / "out").mkdir()
    s3.clear_requests()
    first = _run(s3, tmp_path, "cache", "full", f"--checkpoint-at={CHECKPOINT}")
    assert first.returncode == 0, first.stderr[-4000:]
    # Each rank's cache learned its half; the lock took the other half's identities from
    # the records the ranks exchanged, not from the store.
    assert s3.count("GET", BUCKET) == SHARDS
    assert [_held(tmp_path / "cache", rank) for rank in (0, 1)] == [
        set(range(5)),
        set(range(5, 10)),
    ]
    assert s3.count("HEAD", BUCKET) == 0
    reference = {rank: _batches(tmp_path, "full", rank) for rank in (0, 1)}
    assert len(reference[0]) == len(reference[1]) > CHECKPOINT
    # Rewritten with other samples: read as it is now, it would change the batches' keys.
    s3.put_objects(BUCKET, {f"train-{REWRITTEN:06d}.tar": _shard(REWRITTEN + 50)})
    checkpoint = tmp_path / "out" / f"ckpt-{CHECKPOINT}"
    resumed = _run(s3, tmp_path, "other-node", "resumed", f"--resume={checkpoint}")
    url = f"s3://{BUCKET}/train-{REWRITTEN:06d}.tar"
    if versioning:
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        for rank in (0, 1):
            rest = _batches(tmp_path, "resumed", rank)
            assert reference[rank][:CHECKPOINT] + rest == reference[rank], rank
        gets = s3.requests("GET", f"/{BUCKET}/train-{REWRITTEN:06d}.tar")
        assert any("versionId=" in r.query for r in gets)
    else:
        _names_only_the_rewritten(resumed, url)
        # On the same caches: rank 1's holds the old copy, the kept index the old offsets
        # and identities from the job before are not taken: rank 0 asks the store for
        # each shard its cache does not hold, and names the rewritten one.
        s3.clear_requests()
        again = _run(s3, tmp_path, "cache", "again", f"--resume={checkpoint}")
        _names_only_the_rewritten(again, url)
        # (Each shard at most once: rank 1 may be stopped before it asked for all of its.)
        heads = Counter(r.key for r in s3.requests("HEAD") if r.bucket == BUCKET)
        assert set(heads) >= {f"train-{i:06d}.tar" for i in range(5, 10)}, heads
        assert max(heads.values()) == 1, heads


def _held(cache: Path, rank: int) -> set[int]:
    """The shards of which rank ``rank``'s cache holds a copy."""
    return {int(p.name.split("-")[1]) for p in (cache / f"rank-{rank}" / "data").rglob("*.tar")}


def _names_only_the_rewritten(run: subprocess.CompletedProcess, url: str) -> None:
    assert run.returncode != 0
    assert "DatasetChangedError" in run.stderr
    assert f"1 of {SHARDS} shards changed since the dataset lock" in run.stderr
    assert f"{url}: expected" in run.stderr
    others = [f"train-{i:06d}.tar: expected" for i in range(SHARDS) if i != REWRITTEN]
    assert not any(other in run.stderr for other in others)
