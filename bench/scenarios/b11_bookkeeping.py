"""B11: bookkeeping that does not grow with the cache (issue 14, section 3).

ms per miss and per hit of a size-bounded cache (``max_bytes`` = the shards it holds, so
every miss also evicts the least recently used shard) with 1k, 10k and 100k shards cached,
from local 1 KiB sources (the network out of the picture); and ``status``, ``evict`` and
``verify --quick`` over the largest cache. The peer is the same cache with its index off
(the directory listed on every miss, as before the index; what network file systems still
do), measured in the same run on the same populated directory, with fewer misses at 100k
(each costs a listing of the whole cache).

The cache is populated fast: its files and metadata records are written where the cache
would put them (``layout.identify``, ``meta_path``) with old "last used" times,
then the first bounded miss builds the index from the directory (the rebuild path) before
anything is timed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from bench.support.infra import median


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


KiB = 1024
# cached shards per level, misses (and hits) timed per level, misses timed with the listing
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"levels": (100, 300), "ops": 20, "listing_ops": 5},
    "full": {"levels": (1_000, 10_000, 100_000), "ops": 200, "listing_ops": 10},
}
FLAT = 2.0  # target: cost at the largest level <= FLAT x cost at the smallest
SECONDS = 10.0  # target: status / evict / verify --quick over the largest level


def _populate(cache: Any, src: Path, n: int) -> None:
    """``n`` published shards of 1 KiB with their records, least recently used first,
    written where the cache puts them (plain writes: the cache's own atomic write of each
    record would make populating 100k shards take minutes)."""
    layout = cache.layout
    data = b"p" * KiB
    old = time.time() - 10 * 86400
    made: set[Path] = set()
    for i in range(n):
        url = f"file://{src}/populated-{i:07d}.tar"
        shard = layout.identify(url, "file", "file")
        for directory in (shard.data_path.parent, shard.meta_path.parent):
            if directory not in made:
                layout.make_dir(directory)
                made.add(directory)
        record = {"url": url, "size": KiB, "mtime_ns": 0, "fetched_at": old}
        shard.meta_path.write_text(json.dumps(record))
        with open(shard.data_path, "wb") as f:
            f.write(data)
        os.utime(shard.data_path, (old + i, old + i))


def _sources(src: Path, prefix: str, n: int) -> list[str]:
    urls = []
    for i in range(n):
        path = src / f"{prefix}-{i:06d}.tar"
        path.write_bytes(bytes([i % 256]) * KiB)
        urls.append(str(path))
    return urls


def _ms_each(fn: Any, urls: list[str]) -> float:
    samples = []
    for url in urls:
        t0 = time.perf_counter_ns()
        fn(url)
        samples.append(time.perf_counter_ns() - t0)
    return round(median(samples) / 1e6, 3)


def _level(b: Any, n: int, ops: int, listing_ops: int) -> dict[str, Any]:
    from shardcache import Settings, ShardCache
    from shardcache._base.fsinfo import Mount
    from shardcache._cache.shard_cache import Wiring

    work = b.fresh_dir(f"b11-{n}")
    src = work / "src"
    src.mkdir()
    cache = ShardCache(work / "cache", max_bytes=n * KiB)
    _populate(cache, src, n)
    warm = _sources(src, "warm", 1)
    cache.fetch(warm[0])  # builds the index from the directory: not timed
    urls = _sources(src, "miss", ops)
    miss = _ms_each(cache.fetch, urls)
    hit = _ms_each(cache.fetch, urls)
    # The peer: the same directory, the index off (listed on every miss), as a cache on a
    # network file system keeps it (the wiring's mount says NFS); flock as above, so the
    # listing is the only difference.
    nfs = Mount(mount_point="/", fstype="nfs4", source="bench:/export", options="rw")
    settings = Settings.resolve(cache_dir=work / "cache", max_bytes=n * KiB, lock_mode="flock")
    listing = ShardCache._wired(settings, Wiring(mount_for=lambda path: nfs))
    # Each listed miss costs a listing of the whole cache: fewer of them at 100k.
    listing_ops = listing_ops if n < 100_000 else max(3, listing_ops // 2)
    listing_miss = _ms_each(listing.fetch, _sources(src, "listed", listing_ops))
    if listing._space.index() is not None:  # the peer must be what its row says
        raise RuntimeError("B11: the 'index off' cache kept an index")
    return {"cache": cache, "miss_ms": miss, "hit_ms": hit, "listing_miss_ms": listing_miss}


def _timed_s(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return round(time.perf_counter() - t0, 2), out


def b11_bookkeeping(b: Any) -> dict[str, Any]:
    from shardcache._ops.maintenance import status
    from shardcache._ops.verify import verify

    cfg = SIZES[b.size]
    levels = cfg["levels"]
    res: dict[str, Any] = {}
    listing: dict[str, Any] = {}
    last = None
    for n in levels:
        r = _level(b, n, cfg["ops"], cfg["listing_ops"])
        key = f"{n // 1000}k" if n >= 1000 else str(n)
        res[f"miss_ms_{key}"] = r["miss_ms"]
        res[f"hit_ms_{key}"] = r["hit_ms"]
        listing[f"miss_ms_{key}"] = r["listing_miss_ms"]
        last = r["cache"]
    assert last is not None
    largest = levels[-1]
    status_s, st = _timed_s(lambda: status(last))
    verify_s, vr = _timed_s(lambda: verify(last, quick=True))
    evict_to = largest * KiB * 9 // 10  # evict a tenth of it
    evict_s, ev = _timed_s(lambda: last.evict(evict_to))
    res |= {"status_s": status_s, "verify_quick_s": verify_s, "evict_s": evict_s}
    small, big = levels[0], levels[-1]
    ks = f"{small // 1000}k" if small >= 1000 else str(small)
    kb = f"{big // 1000}k" if big >= 1000 else str(big)
    miss_ratio = round(res[f"miss_ms_{kb}"] / res[f"miss_ms_{ks}"], 2)
    hit_ratio = round(res[f"hit_ms_{kb}"] / res[f"hit_ms_{ks}"], 2)
    checks_ok = (
        st.entries >= largest
        and len(vr.of("ok")) >= largest
        and not vr.of("bad")
        and len(ev.removed) >= largest // 10 - 1
    )
    slowest = max(status_s, verify_s, evict_s)
    return {
        "what": (
            f"median ms per miss (each evicting one) and per hit of a bounded cache holding "
            f"{', '.join(str(n) for n in levels)} shards of 1 KiB, local sources, "
            f"{cfg['ops']} ops per level; status / verify --quick / evict of a tenth over "
            f"{largest} entries in s"
        ),
        "shardcache": res,
        "peers": {"index off (listing per miss, as before)": listing},
        "ratio": miss_ratio,
        "hit_ratio": hit_ratio,
        "status_entries": st.entries,
        "verify_quick_ok": len(vr.of("ok")),
        "evicted": len(ev.removed),
        "target": (
            f"miss and hit at {big} <= {FLAT:g}x at {small}; status, verify --quick and "
            f"evict over {big} entries <= {SECONDS:g} s each"
        ),
        "verdict": verdict(
            miss_ratio <= FLAT and hit_ratio <= FLAT and slowest <= SECONDS and checks_ok
        ),
    }
