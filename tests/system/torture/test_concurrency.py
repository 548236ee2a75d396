"""Many processes x threads read random shards while a small ``max_bytes`` makes eviction
run constantly: zero errors, every byte read equals the source, no shard open by a reader
is ever removed."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from processes import run_together
from torture_scale import scale

from shardcache import ShardCache
from shardcache._disk.layout import CacheLayout
from shardcache._store.eviction import evict_lock, scan

SIZE = 64_000


def _reader(
    cache_dir: str, urls: list[str], seed: int, threads: int, reads: int, fit: int, start, out
):
    import random
    from concurrent.futures import ThreadPoolExecutor

    cache = ShardCache(cache_dir, scope="node", max_bytes=fit * SIZE, retry_backoff=0.01)

    def work(t: int) -> dict:
        rng = random.Random(seed * 1000 + t)
        got: dict = {"reads": 0, "digests": [], "errors": [], "unlinked_while_open": 0}
        for _ in range(reads):
            i = rng.randrange(len(urls))
            try:
                with cache.open(urls[i]) as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                    if os.fstat(f.fileno()).st_nlink == 0:  # removed while we held it open
                        got["unlinked_while_open"] += 1
                got["digests"].append((i, digest))
                got["reads"] += 1
            except Exception as exc:  # counted, reported by the parent
                got["errors"].append(f"{type(exc).__name__}: {exc}")
        return got

    start.wait()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(work, range(threads)))
    out.put((results, cache.stats().as_dict()))


class _SizeSampler(threading.Thread):
    """Measures published + reserved in-flight bytes over and over while the readers run.

    Each sample is taken under the eviction lock, the lock every reservation and eviction
    holds, so it sees a state the cache really was in (never half of an eviction)."""

    def __init__(self, layout: CacheLayout) -> None:
        super().__init__(daemon=True)
        self.layout = layout
        self.samples = 0
        self.largest = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.01):  # pacing, not synchronisation
            with evict_lock(self.layout):
                entries, reserved = scan(self.layout)
            self.largest = max(self.largest, reserved + sum(e.size for e in entries))
            self.samples += 1

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def test_readers_under_constant_eviction(tmp_path: Path, figures) -> None:
    procs, threads, reads = scale(6, 16), scale(2, 4), scale(12, 40)
    # Each reader pins at most one shard (open) or downloads one: max_bytes must hold one
    # per reader (else CacheFullError is the correct answer), plus a little slack; three
    # times as many shards as fit keeps eviction running all the time.
    fit = procs * threads + 8
    shards = 3 * fit
    src = tmp_path / "src"
    src.mkdir()
    urls, digests = [], []
    for i in range(shards):
        data = os.urandom(SIZE)
        (src / f"s{i:03d}.tar").write_bytes(data)
        urls.append(str(src / f"s{i:03d}.tar"))
        digests.append(hashlib.sha256(data).hexdigest())
    cache_dir = tmp_path / "cache"
    sampler = _SizeSampler(CacheLayout(cache_dir / "node"))
    sampler.start()
    try:
        results = run_together(
            _reader,
            [(str(cache_dir), urls, seed, threads, reads, fit) for seed in range(procs)],
        )
    finally:
        sampler.stop()
    per_thread = [t for r, _ in results for t in r]
    errors = [e for t in per_thread for e in t["errors"]]
    total = sum(t["reads"] for t in per_thread)
    wrong = sum(d != digests[i] for t in per_thread for i, d in t["digests"])
    unlinked = sum(t["unlinked_while_open"] for t in per_thread)
    misses = sum(s["misses"] for _, s in results)
    assert not errors, errors[:5]
    assert total == procs * threads * reads
    assert wrong == 0 and unlinked == 0
    cache = ShardCache(cache_dir, scope="node")
    assert sum(e.size for e in cache.entries()) <= fit * SIZE
    # Throughout the run, published + reserved in-flight bytes stayed within max_bytes.
    assert sampler.samples >= 10, sampler.samples
    assert sampler.largest <= fit * SIZE, (sampler.largest, fit * SIZE)
    assert sampler.largest > (fit - procs * threads) * SIZE, "the sampler saw a full cache"
    assert not list(cache_dir.rglob("*.part"))
    assert misses > shards, "eviction should have forced re-downloads"
    figures.add(
        "concurrency",
        f"{procs} processes x {threads} threads reading random shards of {shards}, "
        f"max_bytes = {fit} shards",
        total,
        f"0 errors, 0 wrong bytes (sha256 of every read), 0 shards removed while open; "
        f"{misses} downloads (evictions forced re-downloads); published + reserved bytes "
        f"within max_bytes in all {sampler.samples} samples taken during the run",
    )
