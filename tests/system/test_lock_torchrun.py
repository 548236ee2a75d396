"""The dataset lockfile under torchrun (2 ranks x 2 DataLoader workers, each writing or
reading the lock on its own): a checkpoint, one shard of ten rewritten, and a resume on
another node (empty caches). With bucket versioning the resume reads the recorded version
and every rank yields exactly the batches of the run without the interruption; without
it the job stops naming the rewritten shard (tests/support/resume_job.py is the job)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from processes import job_env, torchrun
from repo import SUPPORT
from tars import shard_samples, tar_bytes

BUCKET = "torchrun-lock"
SHARDS = 10
PER_SHARD = 9
REWRITTEN = 6  # one shard of ten
SPEC = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
CHECKPOINT = 7  # batches of each rank; 15 in the epoch (2 workers x 23 samples / 3)
RUN_TIMEOUT = 120
pytestmark = pytest.mark.timeout(300)


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
        timeout=RUN_TIMEOUT,
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
    first = _run(s3, tmp_path, "cache", "full", f"--checkpoint-at={CHECKPOINT}")
    assert first.returncode == 0, first.stderr[-4000:]
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
        assert resumed.returncode != 0
        assert "DatasetChangedError" in resumed.stderr
        assert f"1 of {SHARDS} shards changed since the dataset lock" in resumed.stderr
        assert f"{url}: expected" in resumed.stderr
        others = [f"train-{i:06d}.tar: expected" for i in range(SHARDS) if i != REWRITTEN]
        assert not any(other in resumed.stderr for other in others)
