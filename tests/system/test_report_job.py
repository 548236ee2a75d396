"""Observability on a real job: ``torchrun`` with 2 ranks x 2 DataLoader workers
(tests/support/metrics_job.py) reads 24 shards from the S3 server through a shaped link that
answers one GET with ``503 SlowDown``, for 3 epochs, with ``SHARDCACHE_METRICS=DIR``.

What the ranks logged, what their files say (summed by ``shardcache report``) and what the
server and the proxy counted must agree; ``--plot`` draws the job's files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from processes import job_env, torchrun
from repo import SUPPORT

from shardcache._cli.main import main
from shardcache._ops.demo import make_shard
from shardcache.testing import FaultProxy, S3Server

JOB = SUPPORT / "metrics_job.py"
BUCKET, SHARDS, PER_SHARD, RANKS, WORKERS, EPOCHS = "metricsjob", 24, 10, 2, 2, 3
SPEC = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
RUN_TIMEOUT = 300


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_torchrun_jobs_logs_files_and_report_agree_with_the_server(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": make_shard(i, PER_SHARD) for i in range(SHARDS)})
    s3.clear_requests()
    metrics = tmp_path / "metrics"
    with FaultProxy("127.0.0.1", s3.port, latency=0.03, conn_rate=1e6) as link:
        link.add_fault("status:503", times=1, method="GET", path_contains="train-000003")
        env = job_env(
            **s3.env(link.endpoint_url),
            SHARDCACHE_METRICS=str(metrics),
            SHARDCACHE_METRICS_INTERVAL="1s",
        )
        command = [
            *torchrun(RANKS, JOB),
            f"--spec={SPEC}",
            f"--cache={tmp_path / 'cache'}",
            f"--epochs={EPOCHS}",
            f"--workers={WORKERS}",
            f"--out={tmp_path}",
        ]
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
        )
        injected = link.stats().faults
    (tmp_path / "job.err").write_text(done.stderr)  # kept with the files, for reading
    assert done.returncode == 0, done.stderr[-5000:]
    assert injected == {"status:503": 1}

    # The ranks' own lines: one per rank and epoch, and rank 0's line for the job.
    for rank in range(RANKS):
        for epoch in range(EPOCHS):
            assert f"shardcache rank {rank} epoch {epoch}: " in done.stderr, done.stderr[-3000:]
    for epoch in range(EPOCHS):
        assert f"shardcache job epoch {epoch}, {RANKS} ranks: " in done.stderr
    lines = [
        json.loads(ln)
        for out in sorted(tmp_path.glob("report-rank*.jsonl"))
        for ln in out.read_text().splitlines()
    ]
    assert len(lines) == RANKS * EPOCHS
    per_shard = SHARDS // RANKS * PER_SHARD
    assert {(ln["rank"], ln["epoch"], ln["samples"]) for ln in lines} == {
        (r, e, per_shard) for r in range(RANKS) for e in range(EPOCHS)
    }
    # The rank lines as dicts (rank 0 returns the job's report from the collective).
    job_lines = [ln["report"] for ln in lines if ln["rank"] == 0]
    assert [r["samples"] for r in job_lines] == [SHARDS * PER_SHARD] * EPOCHS
    assert job_lines[0]["misses"] == SHARDS and job_lines[1]["hits"] == SHARDS

    # The files of all processes (ranks and workers), summed by `shardcache report`.
    files = sorted(metrics.rglob("*.jsonl"))
    # One per process: each rank's training process, and its workers, new every epoch.
    assert len(files) == RANKS * (1 + WORKERS * EPOCHS), files
    assert main(["report", str(metrics), "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    total = job["total"]
    assert sorted(r["rank"] for r in job["ranks"]) == list(range(RANKS))
    assert total["samples"] == SHARDS * PER_SHARD * EPOCHS
    assert (total["misses"], total["hits"], total["shared"]) == (SHARDS, SHARDS * 2, 0)
    # Every request a process counted reached the server, but the one the link answered.
    assert total["requests"]["GET"] == s3.count("GET", BUCKET) + injected["status:503"]
    assert "HEAD" not in total["requests"] and s3.count("HEAD", BUCKET) == 0  # GETs alone
    assert total["retries"]["slowdown"] == 1
    assert sum(total["retries"].values()) == 1
    for rank in job["ranks"]:
        assert rank["data_wait_source"] == "workers"
        assert 0 < rank["data_wait_share"] <= 1

    assert main(["report", str(metrics)]) == 0
    table = capsys.readouterr().out
    (tmp_path / "report.txt").write_text(table)
    assert "total" in table
    png = tmp_path / "report.png"
    assert main(["report", str(metrics), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
