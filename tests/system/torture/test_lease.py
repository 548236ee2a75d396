"""Network file systems: processes on two "nodes" (two JuiceFS mounts of one volume, a real
FUSE network file system whose flock and os.link are shared across mounts:
tools/juicefs.py) race for the same shards. ``lock_mode=auto`` detects JuiceFS and
takes leases, each node its own node-local lock in front of them; exactly once and nothing
lost, as on one disk.

The lease protocol's own cases (dead and silent holders, bad records, crash points, a full
disk) stay on local disks in tests/unit/locking/test_locks.py,
tests/unit/locking/test_lock_conditions.py, test_hostile.py and test_crash.py: there the
point is the protocol, not the file system."""

from __future__ import annotations

import hashlib
import random

from processes import run_together
from torture_scale import scale

from shardcache import ShardCache
from shardcache._disk.layout import is_temp_name

BUCKET = "lease"


def _racer(cache_dir: str, node_lock_dir: str, urls: list[str], seed: int, start, out) -> None:
    cache = ShardCache(cache_dir, scope="node", node_lock_dir=node_lock_dir, lease_time=30)
    assert cache._locks.policy().mode == "lease"  # detected: a network file system
    order = list(urls)
    random.Random(seed).shuffle(order)
    start.wait()
    digests = {u: hashlib.sha256(cache.fetch(u).read_bytes()).hexdigest() for u in order}
    out.put((digests, cache.stats().as_dict()))


def test_lease_mode_race_downloads_each_shard_exactly_once(s3, jfs_nodes, figures) -> None:
    procs, n = scale(6, 16), scale(12, 48)
    rng = random.Random("lease")
    blobs = {f"l-{i:04d}.tar": rng.randbytes(rng.randrange(20_000, 200_000)) for i in range(n)}
    s3.put_objects(BUCKET, blobs)
    urls = {f"s3://{BUCKET}/{k}": hashlib.sha256(v).hexdigest() for k, v in blobs.items()}
    args = [
        (str(node.root / "shared"), str(node.node_lock_dir), list(urls), seed)
        for seed in range(procs)
        for node in [jfs_nodes[seed % 2]]  # half the processes on each node
    ]
    results = run_together(_racer, args)
    assert all(d == urls for d, _ in results), "every process read every shard intact"
    misses = sum(s["misses"] for _, s in results)
    gets = {k: s3.count("GET", BUCKET, k) for k in blobs}
    assert misses == n and set(gets.values()) == {1}, (misses, gets)
    cache_dir = jfs_nodes[0].root / "shared"
    assert not [p for p in cache_dir.rglob("*") if is_temp_name(p.name)]
    assert not list(cache_dir.rglob("*.lease")) and not list(cache_dir.rglob("*.claim"))
    figures.add(
        "network fs (JuiceFS, 2 mounts as 2 nodes)",
        f"{procs} processes on 2 nodes race for the same {n} shards (shuffled order), lease "
        "mode detected, a node lock per node",
        procs * n,
        f"each shard downloaded exactly once (server-side GET count 1 for all {n}); every "
        "read intact; no lease, claim or temp file left",
    )
