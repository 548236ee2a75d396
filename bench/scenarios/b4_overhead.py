"""B4: the per-call overhead of a hit and of the shard lock, against os.stat + open and a
bare filelock."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from bench.support.common import Bench, new_cache, verdict
from bench.support.infra import median


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return median(samples) / 1000  # microseconds


def b4_overhead(b: Bench) -> dict[str, Any]:
    import filelock

    from shardcache._locking.shard_lock import ShardLock

    urls = b.upload("b4", 1, 64_000)
    cache = new_cache(b.fresh_dir("b4"), b.direct)
    path = cache.fetch(urls[0])
    calls = b.cfg["b4_calls"]

    def raw() -> None:
        os.stat(path)
        with open(path, "rb"):
            pass

    def hit() -> None:
        with cache.open(urls[0]):
            pass

    lock_dir = b.fresh_dir("b4locks")
    policy = cache._locks.policy()

    def sc_lock() -> None:
        lock = ShardLock(lock_dir / "x.lock", url=urls[0], policy=policy)
        with lock.hold():
            pass

    bare = filelock.FileLock(str(lock_dir / "bare.lock"))

    def fl_lock() -> None:
        with bare:
            pass

    runs: dict[str, list[float]] = {}
    for _ in range(b.cfg["reps"]):
        for name, fn in (
            ("hit", hit),
            ("raw", raw),
            ("lock", sc_lock),
            ("filelock", fl_lock),
        ):
            runs.setdefault(name, []).append(_per_call(fn, calls))
    m = {k: round(median(v), 1) for k, v in runs.items()}
    return {
        "what": f"median per call over {calls} calls x {b.cfg['reps']} reps",
        "shardcache": {"hit_us": m["hit"], "lock_us": m["lock"]},
        "peers": {"os.stat + open": {"us": m["raw"]}, "bare filelock": {"us": m["filelock"]}},
        "ratio": round(m["hit"] / m["raw"], 2),
        "lock_ratio": round(m["lock"] / m["filelock"], 2),
        "target": "hit <= 50 us, lock acquire+release <= 200 us (medians)",
        "verdict": verdict(m["hit"] <= 50 and m["lock"] <= 200),
    }
