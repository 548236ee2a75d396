"""A smoke run of the benchmark harness at tiny sizes: well-formed results, no timing checks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IDS = [*(f"B{i}" for i in range(1, 9)), "B11"]


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    return []


@pytest.mark.timeout(180)
def test_bench_tiny_produces_well_formed_results(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--size", "tiny", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["size"] == "tiny"
    assert report["machine"]["cores"] >= 1 and report["machine"]["versions"]["python"]
    assert report["server_ceiling"]["mb_s"] > 0
    assert list(report["results"]) == IDS
    for sid, res in report["results"].items():
        assert "error" not in res, (sid, res)
        assert res["verdict"] in {"met", "MISSED"}, sid
        assert res["target"] and res["what"], sid
        numbers = _numbers(res["shardcache"])
        assert numbers and all(math.isfinite(n) and n >= 0 for n in numbers), (sid, res)
        assert res["ratio"] is None or res["ratio"] > 0, sid
        for peer in res["peers"].values():
            assert _numbers(peer), (sid, peer)
    for sid in ("B2", "B3", "B6", "B7"):  # shaped runs report CPU next to the numbers
        assert "machine_cpu_pct" in report["results"][sid]["shardcache"], sid
    assert report["results"]["B3"]["gets_exactly_one_per_shard"] is True
    b8 = report["results"]["B8"]  # every reader of the CPU comparison reports CPU per GB
    assert {"s3fs get", "boto3 download_file"} <= set(b8["peers"])
    assert all(r["cpu_s_per_gb"] > 0 for r in [b8["shardcache"], *b8["peers"].values()])
    table = (tmp_path / "results.md").read_text()
    for sid in IDS:
        assert f"| {sid} |" in table
    b11 = report["results"]["B11"]  # bookkeeping: per level, and the maintenance commands
    assert {"miss_ms_100", "hit_ms_300", "status_s", "verify_quick_s", "evict_s"} <= set(
        b11["shardcache"]
    )
