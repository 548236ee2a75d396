"""B5: the peak memory growth of one large fetch, single stream and parallel ranged GETs."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench.support.common import Bench, new_cache, verdict
from bench.support.infra import BUCKET, CTX, MiB, put


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _b5_child(url: str, so: dict[str, Any], root: str, knobs: tuple[int, int, int], q) -> None:
    parts, part, thr = knobs
    cache = new_cache(Path(root), so, parallel_parts=parts, part_size=part, parallel_threshold=thr)
    cache.remote.info(url)  # warm imports and the client before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = _status_kib("VmRSS")
    t0 = time.monotonic()
    cache.fetch(url)
    wall = time.monotonic() - t0
    peak = _status_kib("VmHWM")
    q.put({"rss_growth_mib": round((peak - base) / 1024, 1), "wall_s": round(wall, 2)})


def _child_fetch(b: Bench, url: str, parts: int, part: int, thr: int, so=None) -> dict[str, Any]:  # noqa: PLR0917
    q = CTX.Queue()
    p = CTX.Process(
        target=_b5_child, args=(url, so or b.direct, str(b.fresh_dir("b5")), (parts, part, thr), q)
    )
    p.start()
    out = q.get(timeout=1200)
    p.join(60)
    return out


def b5_memory(b: Bench) -> dict[str, Any]:
    size = b.cfg["b5"]
    block = os.urandom(16 * MiB if size >= 16 * MiB else size)
    data = block * (size // len(block))
    put(b.s3, {"b5-big.bin": data}, multipart_chunk=64 * MiB if size >= 128 * MiB else None)
    del data
    url = f"s3://{BUCKET}/b5-big.bin"
    single = _child_fetch(b, url, 1, 16 * MiB, 1 << 40)
    obj, part, thr = b.cfg["b6"]
    put(b.s3, {"b5-mid.bin": os.urandom(obj)})
    parallel = _child_fetch(b, f"s3://{BUCKET}/b5-mid.bin", 8, part, thr)
    ok = single["rss_growth_mib"] < 64 and parallel["rss_growth_mib"] < 64
    return {
        "what": f"fetch one {size / MiB:g} MiB object (single stream, direct to the server) in a "
        f"fresh process; and one {obj / MiB:g} MiB object with 8 parallel ranged GETs",
        "shardcache": {"single_" + k: v for k, v in single.items()}
        | {"parallel_" + k: v for k, v in parallel.items()},
        "peers": {},
        "ratio": None,
        "target": "peak RSS growth < 64 MiB",
        "verdict": verdict(ok),
    }
