"""B3: processes on one node, node scope, cold: one GET a shard, wall near one process's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.support.common import Bench, new_cache, read_shardcache, read_wds, summarise, verdict
from bench.support.infra import CpuMeter, MiB, install_wds_s3_opener
from bench.support.processes import run_together


def _b3_worker(kind: str, urls: list[str], so: dict[str, Any], root: str, barrier, q) -> None:  # noqa: PLR0917
    install_wds_s3_opener(so)
    if kind == "shardcache":
        cache = new_cache(Path(root), so, scope="node")
        barrier.wait()
        t0 = time.time()
        out = read_shardcache(urls, cache, threads=4)
    else:
        barrier.wait()
        t0 = time.time()
        out = read_wds(urls, cache_dir=root)
    q.put((t0, time.time(), out))


def _run_procs(kind: str, n: int, urls: list[str], so: dict[str, Any], root: Path) -> float:
    """Wall seconds of ``n`` ``kind`` readers started together: first start to last end."""
    results = run_together(_b3_worker, [(kind, urls, so, str(root))] * n)
    return max(r[1] for r in results) - min(r[0] for r in results)


def b3_node(b: Bench) -> dict[str, Any]:
    count, size, nproc = b.cfg["b3"]
    urls = b.upload("b3", count, size)
    runs: dict[str, list[dict[str, Any]]] = {}
    gets: dict[str, list[int]] = {}
    with b.link() as (so, pids):
        cases = {
            f"shardcache x{nproc}": ("shardcache", nproc),
            "shardcache x1": ("shardcache", 1),
            f"webdataset cache_dir= x{nproc}": ("wds", nproc),
        }
        for _ in range(b.cfg["reps"]):
            for name, (kind, n) in cases.items():
                b.s3.clear_requests()
                root = b.fresh_dir("b3")
                with CpuMeter(pids) as meter:
                    wall = _run_procs(kind, n, urls, so, root)
                runs.setdefault(name, []).append({"wall": wall, **meter.result})
                gets.setdefault(name, []).append(b.gets("b3-"))
    nbytes = count * size
    res = {name: summarise(r, nbytes) for name, r in runs.items()}
    for name in res:  # noqa: PLC0206
        res[name]["gets_per_shard_max"] = round(max(gets[name]) / count, 2)
    s = res.pop(f"shardcache x{nproc}")
    ratio = s["wall_s"] / res["shardcache x1"]["wall_s"]
    one_get = max(gets[f"shardcache x{nproc}"]) == count
    return {
        "what": f"{nproc} processes, node scope, same {count} x {size / MiB:g} MiB shards, cold, "
        f"link: {b.cfg['link'].describe()} (wall from a start barrier after imports)",
        "shardcache": s,
        "peers": res,
        "ratio": round(ratio, 3),
        "gets_exactly_one_per_shard": one_get,
        "target": "exactly one GET per shard; wall <= 1.3 x one process",
        "verdict": verdict(one_get and ratio <= 1.3),
    }
