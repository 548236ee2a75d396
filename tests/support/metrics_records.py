"""Schema-valid "shardcache.metrics" records (version 1, see docs/guides/observability.md), made
by hand for the consumers' tests: ``record(...)`` one record, ``write_job(...)`` the files a
multi-rank job with DataLoader workers writes (one ``.jsonl`` per process)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

T0 = 1_795_000_000.0  # 2026-11-17 UTC


def record(**fields: Any) -> dict[str, Any]:
    """A complete version-1 record with zero counts; ``fields`` override (``start`` and
    ``time`` set ``period_s``; ``data_wait_s`` sets ``data_wait_share``)."""
    rec: dict[str, Any] = {
        "schema": "shardcache.metrics",
        "version": 1,
        "kind": "interval",
        "time": T0 + 10,
        "start": T0,
        "job_id": "4242",
        "host": "scnode1",
        "pid": 1000,
        "rank": 0,
        "local_rank": 0,
        "node_rank": 0,
        "world_size": 1,
        "worker": None,
        "epoch": 0,
        "samples": 0,
        "shards": 0,
        "hits": 0,
        "misses": 0,
        "shared": 0,
        "bytes_downloaded": 0,
        "bytes_served": 0,
        "requests": {"HEAD": 0, "GET": 0},
        "retries": {"reset": 0, "5xx": 0, "slowdown": 0, "truncated": 0, "other": 0},
        "integrity_redownloads": 0,
        "lock_waits": {"count": 0, "seconds": 0.0, "worst_s": 0.0, "worst_holder": None},
        "data_wait_s": 0.0,
        "stall_warnings": 0,
        "stall_errors": 0,
        "slowest_shards": [],
    }
    rec.update(fields)
    rec["period_s"] = rec["time"] - rec["start"]
    rec["data_wait_share"] = rec["data_wait_s"] / rec["period_s"] if rec["period_s"] else 0.0
    return rec


def write_records(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return path


# The synthetic job: 4 ranks on 2 hosts, each a training process (data wait measured there)
# and 2 DataLoader workers (the shardcache stage: samples, shards, I/O). 2 epochs of 60 s,
# interval records every 10 s, an epoch record closing each epoch, a close record at the
# end. Rank 2 is the slow one: cold-cache misses with retries and lock waits in epoch 0.
RANKS, WORKERS, EPOCH_S, INTERVAL_S = 4, 2, 60.0, 10.0
SLOW_RANK = 2


def _wait_share(rank: int, epoch: int, t: float) -> float:
    if rank == SLOW_RANK and epoch == 0:
        return 0.55 if t < 40 else 0.35
    return (0.12 if epoch == 0 else 0.03) + 0.01 * rank


def write_job(root: Path, job_id: str = "4242", *, t0: float = T0) -> dict[str, Any]:
    """Write the synthetic job's files under ``root``; returns its expected sums."""
    expected: dict[str, Any] = {"samples": {}, "misses": {}, "wait": {}, "files": 0}
    for rank in range(RANKS):
        host = f"scnode{1 + rank // 2}"
        base = {"job_id": job_id, "host": host, "rank": rank, "world_size": RANKS}
        base |= {"local_rank": rank % 2, "node_rank": rank // 2}
        main: list[dict[str, Any]] = []
        workers: dict[int, list[dict[str, Any]]] = {w: [] for w in range(WORKERS)}
        samples = misses = 0
        waited = covered = 0.0
        for epoch in range(2):
            e0 = t0 + epoch * EPOCH_S
            ticks = [e0 + INTERVAL_S * i for i in range(int(EPOCH_S / INTERVAL_S) + 1)]
            for begin, end in itertools.pairwise(ticks):
                rel = begin - e0
                share = _wait_share(rank, epoch, rel)
                kind = "epoch" if end == ticks[-1] else "interval"
                start = e0 if kind == "epoch" else begin  # epoch records start at the epoch
                main.append(
                    record(
                        **base,
                        pid=10_000 + rank * 10,
                        kind=kind,
                        start=start,
                        time=end,
                        epoch=epoch,
                        data_wait_s=0.0,  # the stage runs in the workers: they wait
                    )
                )
                waited += share * INTERVAL_S
                covered += INTERVAL_S
                for w in range(WORKERS):
                    slow = rank == SLOW_RANK and epoch == 0
                    n = int((1 - share) * 100) + w
                    miss = 2 if epoch == 0 else 0
                    rec = record(
                        **base,
                        pid=10_000 + rank * 10 + 1 + w,
                        worker=w,
                        kind=kind,
                        start=start,
                        time=end,
                        epoch=epoch,
                        samples=n,
                        shards=4,
                        hits=4 - miss,
                        misses=miss,
                        bytes_downloaded=miss * 50_000_000,
                        bytes_served=4 * 50_000_000,
                        requests={"HEAD": miss, "GET": miss * (3 if slow else 1)},
                        retries={"reset": 0, "5xx": 2 if slow else 0, "slowdown": 0},
                        lock_waits={
                            "count": 1 if slow else 0,
                            "seconds": 2.5 if slow else 0.0,
                            "worst_s": 2.5 if slow else 0.0,
                            "worst_holder": f"pid {10_021 + (1 - w)} on {host}" if slow else None,
                        },
                        stall_warnings=1 if slow and rel == 0 else 0,
                        data_wait_s=share * INTERVAL_S,
                        slowest_shards=[
                            {
                                "url": f"s3://bucket/train-{rank:02d}{int(rel):02d}{w}.tar",
                                "seconds": (8.0 if slow else 1.0) + rel / 100 + w / 10,
                                "bytes": 50_000_000,
                            }
                        ]
                        if miss
                        else [],
                    )
                    workers[w].append(rec)
                    samples += n
                    misses += miss
        main.append(
            record(**base, pid=10_000 + rank * 10, kind="close", start=t0 + 120, time=t0 + 121)
        )
        directory = root / host
        write_records(directory / f"rank{rank}-main.jsonl", main)
        for w, recs in workers.items():
            write_records(directory / f"rank{rank}-worker{w}.jsonl", recs)
        expected["samples"][rank] = samples
        expected["misses"][rank] = misses
        expected["wait"][rank] = waited / covered
        expected["files"] += 1 + WORKERS
    return expected
