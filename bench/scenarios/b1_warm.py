"""B1: a warm cache through the full WebDataset pipeline, against webdataset reading the
same local files."""

from __future__ import annotations

import os
from typing import Any

from bench.support.common import (
    Bench,
    new_cache,
    read_shardcache,
    read_wds,
    summarise,
    timed,
    verdict,
)
from bench.support.infra import MiB


def b1_warm(b: Bench) -> dict[str, Any]:
    count, size = b.cfg["b1"]
    urls = b.upload("b1", count, size)
    cache = new_cache(b.fresh_dir("b1"), b.direct)
    for url in urls:
        cache.fetch(url)
    local = [str(cache.path_for(u)) for u in urls]
    nbytes = sum(os.path.getsize(p) for p in local)
    pids = {"server": b.server_pid}
    sc, peer = [], []
    for _ in range(b.cfg["reps"]):  # interleaved, so drift hits both alike
        peer.append(timed(lambda: read_wds(local), pids))
        sc.append(timed(lambda: read_shardcache(urls, cache, threads=2), pids))
    assert sc[0]["out"] == peer[0]["out"], (sc[0]["out"], peer[0]["out"])
    s, p = summarise(sc, nbytes), summarise(peer, nbytes)
    ratio = s["mb_s"] / p["mb_s"]
    return {
        "what": f"{count} x {size / MiB:g} MiB shards, {sc[0]['out'][0]} samples, warm cache",
        "shardcache": s,
        "peers": {"webdataset (local files, no cache)": p},
        "ratio": round(ratio, 3),
        "target": "throughput >= 0.95 x webdataset on the same local files",
        "verdict": verdict(ratio >= 0.95),
    }
