"""``shardcache report`` and ``--plot`` on the files a real job wrote: 2 ranks of
tests/stall_training_job.py (the WebDataset stage in 2 DataLoader workers each) read 8
shards from moto with ``SHARDCACHE_METRICS=DIR``.

The records come from the producer side of issue 17 (``shardcache._metrics``, built on
another branch): until it is in, the job runs and this test skips at the report step,
saying so."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardcache._cli import main
from shardcache._demo import make_shard

JOB = Path(__file__).with_name("stall_training_job.py")
BUCKET, SHARDS, PER_SHARD, RANKS = "metricsjob", 8, 4, 2


def test_report_and_plot_on_the_files_of_a_real_job(s3, tmp_path, capsys) -> None:
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": make_shard(i, PER_SHARD) for i in range(SHARDS)})
    spec = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
    metrics = tmp_path / "metrics"
    procs = []
    for rank in range(RANKS):
        env = {
            **os.environ,
            **s3.env(),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(RANKS),
            "LOCAL_WORLD_SIZE": str(RANKS),
            "SHARDCACHE_METRICS": str(metrics),
            "SHARDCACHE_METRICS_INTERVAL": "1",
        }
        args = [str(JOB), spec, str(tmp_path / "cache"), s3.endpoint_url, "60", "60"]
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    samples = 0
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        assert "epoch finished" in out
        samples += out.count("sample ")
    assert samples == SHARDS * PER_SHARD

    files = sorted(metrics.rglob("*.jsonl")) if metrics.exists() else []
    if not files and importlib.util.find_spec("shardcache._metrics") is None:
        pytest.skip("the metrics producer (shardcache._metrics, SHARDCACHE_METRICS) is not here")
    assert files, "the job wrote no *.jsonl under SHARDCACHE_METRICS"

    assert main(["report", str(metrics), "--json"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    assert sorted(r["rank"] for r in job["ranks"]) == list(range(RANKS))
    assert job["total"]["samples"] == SHARDS * PER_SHARD
    fetched = job["total"]["hits"] + job["total"]["misses"] + job["total"]["shared"]
    assert fetched == SHARDS and job["total"]["misses"] >= 1
    for rank in job["ranks"]:
        assert rank["data_wait_share"] is None or 0 <= rank["data_wait_share"] <= 1

    png = tmp_path / "wait.png"
    assert main(["report", str(metrics), "--plot", str(png)]) == 0
    assert "total" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
