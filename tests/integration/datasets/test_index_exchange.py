"""Ranks without a torch.distributed process group share learning the sample index through
the job's store or a shared directory (shardcache._datasets.index_exchange): real processes,
each a SLURM task by its variables (task 0 serves the store at SHARDCACHE_RENDEZVOUS_PORT on
127.0.0.1), or ranks of no launcher (SHARDCACHE_RANK / _WORLD_SIZE) meeting in
SHARDCACHE_RENDEZVOUS_DIR, over the moto S3 server. Each shard is fetched once across the
job; a rank that never shows up is an IndexExchangeError naming it, on every rank that
waited, once the bound has passed. (Real launchers: tests/system/test_index_exchange_jobs.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from ports import reserved_port
from processes import TOGETHER_TIMEOUT, run_together
from tars import shard_samples, tar_bytes

BUCKET = "index-exchange"
COUNTS = (5, 9, 6, 7, 8)
SPEC = f"s3://{BUCKET}/train-{{000000..{len(COUNTS) - 1:06d}}}.tar"
# Why a bounded wait for the parts ended, as the error names it: the store's wait timed out
# (SLURM task 0's store), or the shared directory's.
REASONS = ("DistStoreError", "WaitTimeout")
TARS = {f"train-{i:06d}.tar": tar_bytes(shard_samples(i, n)) for i, n in enumerate(COUNTS)}
pytestmark = pytest.mark.timeout(TOGETHER_TIMEOUT)


def rank_env(mode: str, rank: int, ranks: int, where: str, timeout: str, s3_env: dict) -> dict:
    """A rank's variables: a SLURM task's (task 0 serves the store at port ``where``), or,
    with no launcher, shardcache's own rank and world size and the shared directory."""
    if mode == "store":
        launcher = {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": str(ranks),
            "SLURM_NODEID": "0",
            "SLURM_STEP_NODELIST": "127.0.0.1",
            "SHARDCACHE_RENDEZVOUS_PORT": where,
        }
    else:
        launcher = {
            "SHARDCACHE_RANK": str(rank),
            "SHARDCACHE_WORLD_SIZE": str(ranks),
            "SHARDCACHE_RENDEZVOUS_DIR": where,
        }
    return {**s3_env, **launcher, "SHARDCACHE_RENDEZVOUS_TIMEOUT": timeout}


def task(env: dict[str, str], root: str, start: Any, out: Any) -> None:
    """One rank: make the dataset (task 0 of a SLURM step starts serving the store), then,
    with the others, learn its index (prepare); report its counts or the error that
    stopped it."""
    os.environ.update(env)
    from shardcache import IndexExchangeError, ResumableDataset, ShardCache

    dataset = ResumableDataset(SPEC, cache=ShardCache(root), threads=2)  # task 0 serves
    start.wait()
    began = time.monotonic()
    try:
        dataset.prepare()
    except IndexExchangeError as exc:
        out.put(
            {
                "missing": exc.missing,
                "message": str(exc),
                "bound": exc.timeout,
                "waited": time.monotonic() - began,
            }
        )
        return
    out.put({"counts": dataset._epoch_split().counts})


def test_two_ranks_meeting_in_a_shared_directory_learn_each_shard_once(s3, tmp_path: Path) -> None:
    """No launcher: each rank learns its own cache's shards, the parts meet as files.
    (Through a store, under real torchrun and srun: tests/system/test_index_exchange_jobs.py.)"""
    s3.put_objects(BUCKET, TARS)
    s3.clear_requests()
    where = str(tmp_path / "shared")
    envs = [rank_env("directory", rank, 2, where, "60s", s3.env()) for rank in range(2)]
    results = run_together(task, [(env, str(tmp_path / "cache")) for env in envs])
    assert [r.get("counts") for r in results] == [list(COUNTS)] * 2, results
    gets = [r.key for r in s3.requests("GET", f"/{BUCKET}/")]
    assert sorted(gets) == sorted(TARS), gets  # each shard once, by the rank that reads it
    assert len(list((tmp_path / "cache" / ".indexes").glob("*.json"))) == 1
    # No launcher: the parts wait in the job-less folder, for the next job too.
    assert len(list((tmp_path / "shared" / "nojob").glob("*/*/part-*.json"))) == 2


def test_a_rank_that_never_shows_up_is_named(s3, tmp_path: Path) -> None:
    """Ranks 0 and 1 of 3, through a SLURM task 0's store and through a shared directory
    (the two jobs at once): each names rank 2 once the 3 s bound has passed."""
    s3.put_objects(BUCKET, TARS)
    with reserved_port() as port:  # task 0 of the SLURM step serves the store there
        places = {"store": str(port), "directory": str(tmp_path / "shared")}
        envs = [
            rank_env(mode, rank, 3, where, "3s", s3.env())
            for mode, where in places.items()
            for rank in range(2)
        ]
        results = run_together(task, [(env, str(tmp_path / "cache")) for env in envs])
    assert len(results) == 4
    for result in results:
        assert result.get("missing") == [2], result
        assert "ranks 2 of 3 gave no part of the sample index" in result["message"]
        assert "SHARDCACHE_RENDEZVOUS_TIMEOUT" in result["message"]
        # Given up at its own 3 s bound, when the wait for the parts ran out (not at a
        # connection error, nor at another bound), and not before: the machine's speed
        # decides only how late after the bound the error comes.
        assert result["bound"] == 3 and "within 3s" in result["message"], result
        assert any(f"within 3s ({why})" in result["message"] for why in REASONS), result
        assert result["waited"] >= 3, result
    assert sum("the shared directory" in r["message"] for r in results) == 2
