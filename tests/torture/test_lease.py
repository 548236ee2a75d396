"""Network file systems: lease locks (forced, as on NFS where flock is unavailable or
misleading) give the same exactly-once and nothing-lost results under a process race."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from processes import run_together
from torture_scale import scale

from shardcache import ShardCache
from shardcache._layout import is_temp_name

BUCKET = "lease"


def _racer(cache_dir: str, urls: list[str], seed: int, start, out) -> None:
    cache = ShardCache(cache_dir, scope="node", lock_mode="lease", lease_time=30)
    order = list(urls)
    random.Random(seed).shuffle(order)
    start.wait(120)
    digests = {u: hashlib.sha256(cache.fetch(u).read_bytes()).hexdigest() for u in order}
    out.put((digests, cache.stats().as_dict()))


def test_lease_mode_race_downloads_each_shard_exactly_once(s3, tmp_path: Path, figures) -> None:
    procs, n = scale(6, 16), scale(12, 48)
    rng = random.Random("lease")
    blobs = {f"l-{i:04d}.tar": rng.randbytes(rng.randrange(20_000, 200_000)) for i in range(n)}
    s3.put_objects(BUCKET, blobs)
    urls = {f"s3://{BUCKET}/{k}": hashlib.sha256(v).hexdigest() for k, v in blobs.items()}
    cache_dir = tmp_path / "shared"
    results = run_together(
        _racer, [(str(cache_dir), list(urls), seed) for seed in range(procs)], timeout=600
    )
    assert all(d == urls for d, _ in results), "every process read every shard intact"
    misses = sum(s["misses"] for _, s in results)
    gets = {k: s3.count("GET", BUCKET, k) for k in blobs}
    assert misses == n and set(gets.values()) == {1}, (misses, gets)
    assert not [p for p in cache_dir.rglob("*") if is_temp_name(p.name)]
    assert not list(cache_dir.rglob("*.lease")) and not list(cache_dir.rglob("*.claim"))
    figures.add(
        "network fs (forced lease locks)",
        f"{procs} processes race for the same {n} shards (shuffled order)",
        procs * n,
        f"each shard downloaded exactly once (server-side GET count 1 for all {n}); every "
        "read intact; no lease, claim or temp file left",
    )
