"""Jobs without a torch.distributed process group learn the sample index once across the
job, through the store the launcher gives them.

tests/support/index_exchange_job.py iterates a ``ResumableDataset`` (rank scope, no index)
through a DataLoader with 2 workers on every rank and never initialises a process group, so
the dataset first meets its shards in the workers, every epoch anew. Over the S3 server's
request log, split at the job's epoch marks: epoch 0 must fetch every shard and make at most
shards + caches GETs (each rank's first worker learns its own cache's shards, the ranks
exchange their parts; evening the caches out reads at most one more shard a cache), epoch 1
none at all, and every epoch delivers every sample. Under torchrun (2 ranks) the parts go
through torchrun's agent store; as 2 plain ``srun`` tasks on the one-node SLURM cluster of
``scripts/slurm-local`` (the ``slurm`` fixture of tests/system/test_slurm.py), through the
store task 0 serves on the step's first node at the port derived from the job id.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from processes import job_env, torchrun
from repo import SUPPORT
from test_ddp_epochs import UNEQUAL, all_keys, requests_by_epoch
from test_slurm import (
    PYTHON,
    slurm,  # noqa: F401 (the module fixture: skipped or failed as test_slurm's tests)
    srun,
    task_env,
)
from test_slurm_epochs import (  # the unequal shards in the S3 server
    BUCKET,
    MARK_BUCKET,
    SPEC,
    shards,  # noqa: F401 (a fixture)
)

from shardcache.testing import S3Server

JOB = SUPPORT / "index_exchange_job.py"
RANKS = 2
RUN_TIMEOUT = 120
pytestmark = pytest.mark.timeout(300)


def job_args(root: Path, s3: S3Server) -> list[str]:
    return [
        f"--spec={SPEC}",
        f"--cache={root / 'cache'}",
        f"--out={root / 'out'}",
        "--epochs=2",
        "--workers=2",
        f"--mark-epochs={s3.endpoint_url}/{MARK_BUCKET}",
    ]


def check_job(root: Path, s3: S3Server, tars: dict[str, bytes]) -> None:
    """Epoch 0: every shard, at most shards + caches GETs; epoch 1: none; every epoch
    delivers every sample (padded to equal shares)."""
    gets, methods = requests_by_epoch(s3, BUCKET, MARK_BUCKET)
    print(f"requests by epoch: {[dict(m) for m in methods]}")
    assert len(gets) == 3, "the job did not mark the end of each of its 2 epochs"
    first, second, after = gets
    assert set(first) == set(tars)
    assert first.total() <= len(tars) + RANKS, dict(first)
    assert not second, f"epoch 1 made GETs: {dict(second)}"
    assert not after
    for epoch in (0, 1):
        delivered: Counter[str] = Counter()
        for rank in range(RANKS):
            lines = (root / "out" / f"rank-{rank}.jsonl").read_text().splitlines()
            delivered.update(json.loads(lines[epoch])["keys"])
        assert set(delivered) == set(all_keys(UNEQUAL)), epoch
        assert delivered.total() == 4 * 231  # 921 samples padded to 4 equal shares


def test_torchrun_workers_exchange_through_the_agent_store(
    s3: S3Server,
    shards: dict[str, bytes],  # noqa: F811
    tmp_path: Path,
) -> None:
    command = torchrun(RANKS, JOB, *job_args(tmp_path, s3))
    done = subprocess.run(
        command,
        env=job_env(**s3.env()),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    check_job(tmp_path, s3, shards)
    assert "exchanged through torchrun's store at" in done.stdout, done.stdout[-3000:]
    assert "learning the sample offsets of all" not in done.stdout


def test_srun_tasks_exchange_through_task_zeros_store(
    slurm: str,  # noqa: F811
    s3: S3Server,
    shards: dict[str, bytes],  # noqa: F811
    tmp_path: Path,
) -> None:
    out = srun([PYTHON, str(JOB), *job_args(tmp_path, s3)], task_env(s3), tmp_path, ntasks=RANKS)
    check_job(tmp_path, s3, shards)
    assert "exchanged through SLURM's store at" in out, out[-3000:]
    assert "learning the sample offsets of all" not in out
