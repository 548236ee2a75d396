"""B7: latency hiding at a fixed consumer rate: how long a consumer waits for data."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.support import peers
from bench.support.common import (
    Bench,
    clear_fs_caches,
    new_cache,
    read_shardcache,
    read_wds,
    verdict,
)
from bench.support.infra import (
    MB,
    CpuMeter,
    MiB,
    install_wds_s3_opener,
    median,
    presigned,
    samples_per_shard,
)


def b7_hiding(b: Bench) -> dict[str, Any]:
    """A consumer doing fixed per-sample work: how long it waits for data, apart from its work."""

    count, size = b.cfg["b7"]
    urls = b.upload("b7", count, size)
    rate = b.cfg["b7_rate"]
    t = min(4, b.cfg["threads"])
    per_sample = (b.cfg["sample"] + 100) / rate
    per_shard = samples_per_shard(size, b.cfg["sample"])

    def consume(reader: Callable[[Callable[[], None]], Any]) -> dict[str, float]:
        t0 = time.monotonic()
        st = {"first": 0.0, "from": 0.0, "last": t0, "wait": 0.0, "work": 0.0, "n": 0}

        def on_sample() -> None:
            now = time.monotonic()
            if st["n"] == 0:
                st["first"] = now - t0
            if st["n"] == per_shard:  # the first sample of the second shard: clock starts
                st["from"] = now
            elif st["n"] > per_shard:
                st["wait"] += now - st["last"]
            st["n"] += 1
            time.sleep(per_sample)  # the "training step": the pipeline's own per-sample work
            st["last"] = time.monotonic()
            if st["n"] > per_shard:
                st["work"] += st["last"] - now

        n, _ = reader(on_sample)
        if n != count * per_shard:
            raise RuntimeError(f"B7 reader yielded {n} samples, expected {count * per_shard}")
        wall = time.monotonic() - st["from"]
        return {
            "wall": wall,
            "wait": st["wait"],
            "work": st["work"],
            "first": st["first"],
        }

    def sc(cb: Callable[[], None]) -> Any:
        return read_shardcache(urls, new_cache(b.fresh_dir("b7"), so), threads=t, on_sample=cb)

    runs: dict[str, list[dict[str, Any]]] = {}
    with b.link() as (so, pids):
        install_wds_s3_opener(so)
        streamed = presigned(b.s3.boto3_client(so["endpoint_url"]), urls)
        readers: dict[str, Callable[[Callable[[], None]], Any]] = {
            f"shardcache threads={t}": sc,
            "webdataset cache_dir= (one process)": lambda cb: read_wds(
                urls, cache_dir=str(b.fresh_dir("b7w")), on_sample=cb
            ),
            f"webdataset cache_dir=, DataLoader(num_workers={t})": lambda cb: peers.read_wds_loader(
                urls, t, cache_dir=str(b.fresh_dir("b7w")), on_sample=cb
            ),
            f"webdataset streaming, DataLoader(num_workers={t})": lambda cb: peers.read_wds_loader(
                streamed, t, on_sample=cb
            ),
        }
        for rep in range(b.cfg["reps"]):
            order = list(readers) if rep % 2 == 0 else list(reversed(readers))  # alternate
            for name in order:
                clear_fs_caches()
                with CpuMeter(pids) as m:
                    r = consume(readers[name])
                runs.setdefault(name, []).append(r | m.result)

    def summ(rs: list[dict[str, Any]]) -> dict[str, Any]:
        out = {
            "wait_pct": round(100 * median([r["wait"] / max(r["wall"], 1e-9) for r in rs]), 2),
            "wait_s": round(median([r["wait"] for r in rs]), 2),
            "work_s": round(median([r["work"] for r in rs]), 2),
            "wall_s": round(median([r["wall"] for r in rs]), 2),
            "first_sample_s": round(median([r["first"] for r in rs]), 2),
        }
        for key in rs[0]:
            if key.endswith("_cpu_pct"):
                out[key] = round(median([r[key] for r in rs]), 1)
        return out

    res = {n: summ(r) for n, r in runs.items()}
    s = res.pop(f"shardcache threads={t}")
    return {
        "what": f"{count} x {size / MiB:g} MiB shards, consumer at {rate / MB:g} MB/s "
        f"(per-sample work: a {per_sample * 1000:.1f} ms sleep), link: "
        f"{b.cfg['link'].describe()}; after the first shard: wait_s = waiting for data, "
        "work_s = the pipeline's own per-sample work, wall_s = both and the loop",
        "shardcache": s,
        "peers": res,
        "ratio": None,
        "target": "consumer waits <= 5% of wall time after the first shard",
        "verdict": verdict(s["wait_pct"] <= 5),
    }
