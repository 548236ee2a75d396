"""shardcache benchmarks B1-B8 against their peers; writes bench/results.{md,json}.

    python -m bench.run [--size tiny|full] [--out DIR] [--only B2,B6]

Every timed scenario reports medians of several repetitions and ratios to its peer;
shaped scenarios go through a FaultProxy (own process) in front of a moto server (own
process) and report CPU use next to the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.b11_bookkeeping import b11_bookkeeping
from bench.infra import (
    BUCKET,
    CTX,
    MB,
    CpuMeter,
    Link,
    MiB,
    count_samples,
    install_wds_s3_opener,
    machine,
    make_shard,
    median,
    put,
    shaped_proxy,
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "reps": 1,
        "sample": 20_000,
        "b1": (4, 256_000),
        "b2": (3, 400_000),
        "b3": (4, 200_000, 2),
        "b4_calls": 200,
        "b5": 8 * MiB,
        "b6": (4 * MiB, 1 * MiB, 2 * MiB),  # object, part size, threshold
        "b7": (3, 300_000),
        "link": Link(0.01, 4 * MB, 10 * MB),
        "b7_rate": 2 * MB,
        "ceiling": (2, 1 * MiB),
        "b8": (2, 2 * MiB),
    },
    "full": {
        "reps": 3,
        "sample": 100_000,
        "b1": (32, 16 * MiB),
        "b2": (12, 8 * MiB),
        "b3": (32, 4 * MiB, 8),
        "b4_calls": 5000,
        "b5": 1024 * MiB,
        "b6": (128 * MiB, 16 * MiB, 64 * MiB),
        "b7": (16, 8 * MiB),
        "link": Link(0.04, 10 * MB, 50 * MB),
        "b7_rate": 20 * MB,
        "ceiling": (8, 16 * MiB),
        "b8": (8, 32 * MiB),
    },
}
THREADS = 8  # shardcache prefetch threads in the shaped scenarios (SHARDCACHE_THREADS)


class Bench:
    def __init__(self, size: str, work: Path) -> None:
        from shardcache.testing import S3Server

        self.size = size
        self.cfg = SIZES[size]
        self.work = work
        self.s3 = S3Server().start()
        self.server_pid = self.s3._proc.pid  # type: ignore[union-attr]
        self.direct = self.s3.storage_options()
        for k, v in self.s3.env().items():
            os.environ[k] = v
        self._n = 0

    def close(self) -> None:
        self.s3.stop()

    def fresh_dir(self, name: str) -> Path:
        self._n += 1
        path = self.work / f"{name}-{self._n}"
        path.mkdir(parents=True)
        return path

    def upload(self, prefix: str, count: int, size: int) -> list[str]:
        objects = {
            f"{prefix}-{i:06d}.tar": make_shard(size, self.cfg["sample"], i) for i in range(count)
        }
        put(self.s3, objects)
        return [f"s3://{BUCKET}/{k}" for k in objects]

    @contextlib.contextmanager
    def link(self, link: Link | None = None) -> Iterator[tuple[dict[str, Any], dict[str, int]]]:
        with shaped_proxy(self.s3.port, link or self.cfg["link"]) as (endpoint, pid):
            yield self.s3.storage_options(endpoint), {"server": self.server_pid, "proxy": pid}

    def gets(self, prefix: str) -> int:
        return sum(1 for r in self.s3.requests("GET") if r.key.startswith(prefix))


def _clear_fs_caches() -> None:
    import fsspec
    import s3fs

    fsspec.AbstractFileSystem.clear_instance_cache()
    s3fs.S3FileSystem.clear_instance_cache()


def _cache(root: Path, storage_options: dict[str, Any], **kw: Any):
    from shardcache import ShardCache

    return ShardCache(root, storage_options=storage_options, **kw)


# ---------------------------------------------------------------------------- readers
def read_shardcache(urls: list[str], cache: Any, threads: int = THREADS, on_sample=None):
    import webdataset as wds

    import shardcache

    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        shardcache.tarfile_to_samples(cache=cache, threads=threads, depth=2 * threads),
    )
    try:
        return count_samples(iter(pipeline), on_sample)
    finally:
        pipeline.close()


def read_wds(urls: list[str], cache_dir: str | None = None, on_sample=None):
    import webdataset as wds

    ds = wds.WebDataset(
        urls, shardshuffle=False, cache_dir=cache_dir, nodesplitter=None, empty_check=False
    )
    return count_samples(iter(ds), on_sample)


def read_fsspec(urls: list[str], chain: str | None, storage_options: dict[str, Any], d: str):
    import fsspec
    import webdataset as wds

    def opener(src):
        for item in src:
            url = item["url"]
            if chain is None:
                stream = fsspec.open(url, "rb", **storage_options).open()
            else:
                stream = fsspec.open(
                    f"{chain}::{url}", "rb", s3=storage_options, **{chain: {"cache_storage": d}}
                ).open()
            try:
                yield {"url": url, "stream": stream}
            finally:
                stream.close()

    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls), opener, wds.tariterators.tar_file_expander
    )
    from webdataset.tariterators import group_by_keys

    return count_samples(group_by_keys(iter(pipeline)))


def timed(fn: Callable[[], Any], pids: dict[str, int]) -> dict[str, Any]:
    with CpuMeter(pids) as meter:
        t0 = time.monotonic()
        out = fn()
        wall = time.monotonic() - t0
    return {"wall": wall, "out": out, **meter.result}


def summarise(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    wall = median([r["wall"] for r in runs])
    res = {"wall_s": round(wall, 3), "mb_s": round(nbytes / MB / wall, 2), "reps": len(runs)}
    for key in runs[0]:
        if key.endswith("_cpu_pct"):
            res[key] = round(median([r[key] for r in runs]), 1)
    return res


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ---------------------------------------------------------------------------- scenarios
def server_ceiling(b: Bench) -> dict[str, Any]:
    """What moto serves unshaped: whole-object GETs from 4 client threads."""
    from concurrent.futures import ThreadPoolExecutor

    count, size = b.cfg["ceiling"]
    objects = {f"ceil-{i}.bin": os.urandom(size) for i in range(count)}
    put(b.s3, objects)
    client = b.s3.boto3_client()

    def get(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    runs = []
    for _ in range(b.cfg["reps"]):
        with ThreadPoolExecutor(4) as pool:
            runs.append(timed(lambda: sum(pool.map(get, objects)), {"server": b.server_pid}))
    return summarise(runs, count * size)


def b1_warm(b: Bench) -> dict[str, Any]:
    count, size = b.cfg["b1"]
    urls = b.upload("b1", count, size)
    cache = _cache(b.fresh_dir("b1"), b.direct)
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


def b2_cold(b: Bench) -> dict[str, Any]:
    count, size = b.cfg["b2"]
    urls = b.upload("b2", count, size)
    link: Link = b.cfg["link"]
    nbytes = sum(len(x) for x in [b""]) or 0
    nbytes = sum(
        b.s3.boto3_client().head_object(Bucket=BUCKET, Key=u.split("/", 3)[3])["ContentLength"]
        for u in urls
    )
    results: dict[str, list[dict[str, Any]]] = {}
    gets: dict[str, int] = {}
    with b.link() as (so, pids):
        install_wds_s3_opener(so)
        peers: dict[str, Callable[[], Any]] = {
            "shardcache": lambda: read_shardcache(urls, _cache(b.fresh_dir("b2"), so)),
            "webdataset cache_dir=": lambda: read_wds(urls, cache_dir=str(b.fresh_dir("b2w"))),
            "fsspec filecache::": lambda: read_fsspec(urls, "filecache", so, str(b.fresh_dir("f"))),
            "fsspec simplecache::": lambda: read_fsspec(
                urls, "simplecache", so, str(b.fresh_dir("s"))
            ),
            "s3fs streaming": lambda: read_fsspec(urls, None, so, ""),
        }
        for _ in range(b.cfg["reps"]):
            for name, fn in peers.items():
                _clear_fs_caches()
                b.s3.clear_requests()
                results.setdefault(name, []).append(timed(fn, pids))
                gets[name] = b.gets("b2-")
    s = summarise(results["shardcache"], nbytes)
    peer_res = {n: summarise(r, nbytes) for n, r in results.items() if n != "shardcache"}
    for name, res in [("shardcache", s), *peer_res.items()]:
        res["gets_per_shard"] = round(gets[name] / count, 2)
    wds_ratio = s["mb_s"] / peer_res["webdataset cache_dir="]["mb_s"]
    link_frac = s["mb_s"] / (link.total_rate / MB)
    return {
        "what": f"{count} x {size / MiB:g} MiB shards, cold, link: {link.describe()}; "
        f"shardcache threads={THREADS}",
        "shardcache": s,
        "peers": peer_res,
        "ratio": round(wds_ratio, 2),
        "link_fraction": round(link_frac, 3),
        "target": ">= 3x webdataset cache_dir, >= 85% of the aggregate link limit",
        "verdict": verdict(wds_ratio >= 3 and link_frac >= 0.85),
    }


def _b3_worker(kind: str, urls: list[str], so: dict[str, Any], root: str, barrier, q) -> None:  # noqa: PLR0917
    install_wds_s3_opener(so)
    if kind == "shardcache":
        cache = _cache(Path(root), so, scope="node")
        barrier.wait()
        t0 = time.time()
        out = read_shardcache(urls, cache, threads=4)
    else:
        barrier.wait()
        t0 = time.time()
        out = read_wds(urls, cache_dir=root)
    q.put((t0, time.time(), out))


def _run_procs(kind: str, n: int, urls: list[str], so: dict[str, Any], root: Path) -> float:
    barrier, q = CTX.Barrier(n), CTX.Queue()
    procs = [
        CTX.Process(target=_b3_worker, args=(kind, urls, so, str(root), barrier, q))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"B3 {kind} worker failed")
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


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return median(samples) / 1000  # microseconds


def b4_overhead(b: Bench) -> dict[str, Any]:
    import filelock

    from shardcache._locks import ShardLock

    urls = b.upload("b4", 1, 64_000)
    cache = _cache(b.fresh_dir("b4"), b.direct)
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
    policy = cache._lock_policy()

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


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _b5_child(url: str, so: dict[str, Any], root: str, knobs: tuple[int, int, int], q) -> None:
    parts, part, thr = knobs
    cache = _cache(Path(root), so, parallel_parts=parts, part_size=part, parallel_threshold=thr)
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


def b6_large(b: Bench) -> dict[str, Any]:
    import fsspec

    obj, part, thr = b.cfg["b6"]
    put(b.s3, {"b6-big.bin": os.urandom(obj)})
    url = f"s3://{BUCKET}/b6-big.bin"
    link: Link = b.cfg["link"]
    runs: dict[str, list[dict[str, Any]]] = {}
    gets: dict[str, int] = {}
    # The server's own ceiling for this access pattern: the same ranged download, unshaped.
    unshaped = []
    for _ in range(b.cfg["reps"]):
        cache = _cache(b.fresh_dir("b6u"), b.direct, part_size=part, parallel_threshold=thr)
        unshaped.append(timed(lambda: cache.fetch(url), {"server": b.server_pid}))  # noqa: B023
    with b.link() as (so, pids):
        for _ in range(b.cfg["reps"]):
            b.s3.clear_requests()
            cache = _cache(b.fresh_dir("b6"), so, part_size=part, parallel_threshold=thr)
            runs.setdefault("shardcache", []).append(timed(lambda: cache.fetch(url), pids))  # noqa: B023
            gets["shardcache"] = b.gets("b6-")
            _clear_fs_caches()
            b.s3.clear_requests()
            dest = b.fresh_dir("b6p") / "x.bin"
            fs = fsspec.filesystem("s3", **so)
            runs.setdefault("s3fs get", []).append(timed(lambda: fs.get(url, str(dest)), pids))  # noqa: B023
            gets["s3fs get"] = b.gets("b6-")
    s = summarise(runs["shardcache"], obj)
    p = summarise(runs["s3fs get"], obj)
    s["gets"], p["gets"] = gets["shardcache"], gets["s3fs get"]
    frac = s["mb_s"] / (link.total_rate / MB)
    return {
        "what": f"one {obj / MiB:g} MiB object, {part / MiB:g} MiB parts x 8 in flight, "
        f"link: {link.describe()}",
        "shardcache": s,
        "peers": {"s3fs get": p},
        "server_ranged_ceiling": summarise(unshaped, obj),
        "ratio": round(s["mb_s"] / p["mb_s"], 2),
        "link_fraction": round(frac, 3),
        "target": ">= 85% of the aggregate cap",
        "verdict": verdict(frac >= 0.85),
    }


def b7_hiding(b: Bench) -> dict[str, Any]:
    count, size = b.cfg["b7"]
    urls = b.upload("b7", count, size)
    rate = b.cfg["b7_rate"]
    per_sample = (b.cfg["sample"] + 100) / rate

    def consume(reader: Callable[[Callable[[], None]], Any]) -> dict[str, float]:
        state = {"first": None, "last": time.monotonic(), "wait": 0.0, "n": 0}
        per_shard = max(1, size // (b.cfg["sample"] + 1536))

        def on_sample() -> None:
            now = time.monotonic()
            if state["n"] == per_shard:  # the first sample of the second shard
                state["first"] = now
            elif state["first"] is not None:
                state["wait"] += now - state["last"]
            state["n"] += 1
            time.sleep(per_sample)  # the "training step"
            state["last"] = time.monotonic()

        reader(on_sample)
        wall = time.monotonic() - (state["first"] or time.monotonic())
        return {"wall": wall, "wait_frac": state["wait"] / max(wall, 1e-9)}

    runs: dict[str, list[dict[str, Any]]] = {}
    with b.link() as (so, pids):
        install_wds_s3_opener(so)
        for _ in range(b.cfg["reps"]):
            _clear_fs_caches()
            cache = _cache(b.fresh_dir("b7"), so)
            with CpuMeter(pids) as m:
                r = consume(lambda cb: read_shardcache(urls, cache, threads=4, on_sample=cb))  # noqa: B023
            runs.setdefault("shardcache", []).append(r | m.result)
            _clear_fs_caches()
            d = str(b.fresh_dir("b7w"))
            with CpuMeter(pids) as m:
                r = consume(lambda cb: read_wds(urls, cache_dir=d, on_sample=cb))  # noqa: B023
            runs.setdefault("webdataset cache_dir=", []).append(r | m.result)

    def summ(rs: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"wait_pct": round(100 * median([r["wait_frac"] for r in rs]), 2)}
        out["wall_s"] = round(median([r["wall"] for r in rs]), 2)
        for key in rs[0]:
            if key.endswith("_cpu_pct"):
                out[key] = round(median([r[key] for r in rs]), 1)
        return out

    s, p = summ(runs["shardcache"]), summ(runs["webdataset cache_dir="])
    return {
        "what": f"{count} x {size / MiB:g} MiB shards, consumer at {rate / MB:g} MB/s, "
        f"link: {b.cfg['link'].describe()}; shardcache threads=4",
        "shardcache": s,
        "peers": {"webdataset cache_dir=": p},
        "ratio": None,
        "target": "consumer waits <= 5% of wall time after the first shard",
        "verdict": verdict(s["wait_pct"] <= 5),
    }


def _client_cpu_s(fn: Callable[[], Any]) -> tuple[float, float]:
    """(CPU seconds of this process and its children, wall seconds) spent in ``fn``."""
    with CpuMeter({}) as meter:
        t0 = time.monotonic()
        fn()
        wall = time.monotonic() - t0
    return meter.result["client_cpu_pct"] / 100 * wall, wall


def b8_cpu(b: Bench) -> dict[str, Any]:
    """Client CPU per GB of a cold fetch, every reader one object at a time, unshaped."""
    import fsspec

    count, size = b.cfg["b8"]
    objects = {f"b8-{i:03d}.bin": os.urandom(size) for i in range(count)}
    put(b.s3, objects)
    keys = list(objects)

    def shardcache_fetch() -> None:
        cache = _cache(b.fresh_dir("b8"), b.direct)  # verify on (size + MD5 of the ETag)
        for key in keys:
            cache.fetch(f"s3://{BUCKET}/{key}")

    def s3fs_get() -> None:
        dest = b.fresh_dir("b8p")
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **b.direct)
        for key in keys:
            fs.get(f"s3://{BUCKET}/{key}", str(dest / key))

    def s3fs_read() -> None:
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **b.direct)
        for key in keys:
            with fs.open(f"s3://{BUCKET}/{key}", "rb", block_size=8 * MiB) as f:
                while f.read(8 * MiB):
                    pass

    def boto3_download() -> None:
        dest = b.fresh_dir("b8p")
        client = b.s3.boto3_client()
        for key in keys:
            client.download_file(BUCKET, key, str(dest / key))

    # Signed before the clock starts: curl's own work is the floor being measured.
    signer = b.s3.boto3_client()
    signed = {
        key: signer.generate_presigned_url("get_object", {"Bucket": BUCKET, "Key": key}, 3600)
        for key in keys
    }

    def curl() -> None:  # the floor: a C client writing the file, no verification
        dest = b.fresh_dir("b8p")
        for key in keys:
            subprocess.run(["curl", "-sSf", "-o", str(dest / key), signed[key]], check=True)

    readers: dict[str, Callable[[], None]] = {
        "shardcache fetch": shardcache_fetch,
        "s3fs get": s3fs_get,
        "boto3 download_file": boto3_download,
        "s3fs streaming read (no file)": s3fs_read,
    }
    if shutil.which("curl"):
        readers["curl -o (floor)"] = curl
    gb = count * size / 1e9
    runs: dict[str, list[tuple[float, float]]] = {}
    for rep in range(b.cfg["reps"]):
        order = list(readers) if rep % 2 == 0 else list(reversed(readers))  # alternate
        for name in order:
            _clear_fs_caches()
            runs.setdefault(name, []).append(_client_cpu_s(readers[name]))

    def summ(rs: list[tuple[float, float]]) -> dict[str, Any]:
        return {
            "cpu_s_per_gb": round(median([cpu for cpu, _ in rs]) / gb, 2),
            "wall_s": round(median([wall for _, wall in rs]), 3),
            "reps": len(rs),
        }

    results = {name: summ(rs) for name, rs in runs.items()}
    s = results.pop("shardcache fetch")
    ratio = round(s["cpu_s_per_gb"] / results["s3fs get"]["cpu_s_per_gb"], 2)
    return {
        "what": f"{count} x {size / MiB:g} MiB objects fetched cold, one at a time, direct to "
        "the server; client CPU (user + sys of the process, its threads and children) per GB",
        "shardcache": s,
        "peers": results,
        "ratio": ratio,
        "target": "<= 0.8 x s3fs get CPU per GB (verification on)",
        "verdict": verdict(ratio <= 0.8),
    }


SCENARIOS: dict[str, tuple[str, Callable[[Bench], dict[str, Any]]]] = {
    "B1": ("warm cache, full WebDataset pipeline", b1_warm),
    "B2": ("cold cache over the shaped link", b2_cold),
    "B3": ("processes on one node, node scope, cold", b3_node),
    "B4": ("per-call overhead", b4_overhead),
    "B5": ("memory of a large fetch", b5_memory),
    "B6": ("large single object over the shaped link", b6_large),
    "B7": ("latency hiding at a fixed consumer rate", b7_hiding),
    "B8": ("client CPU per GB of a cold fetch", b8_cpu),
    "B11": ("bookkeeping cost vs the number of cached shards", b11_bookkeeping),
}


# ---------------------------------------------------------------------------- report
def _other_cpu(res: dict[str, Any], cores: int) -> dict[str, Any]:
    """Add ``other_cpu_pct``: machine CPU not used by the client, server or proxy."""
    if "machine_cpu_pct" not in res:
        return res
    ours = sum(v for k, v in res.items() if k.endswith("_cpu_pct") and k != "machine_cpu_pct")
    other = max(0.0, res["machine_cpu_pct"] * cores - ours)
    return res | {"other_cpu_pct": round(other, 1)}


def _fmt(res: dict[str, Any], cores: int = 1) -> str:
    res = _other_cpu(res, cores)
    keep = [
        (k, v)
        for k, v in res.items()
        if k not in {"reps"} and not (k.endswith("_cpu_pct") and k != "machine_cpu_pct")
    ]
    text = ", ".join(f"{k}={v}" for k, v in keep)
    cpu = [
        f"{k[:-8]} {v:g}%"
        for k, v in res.items()
        if k.endswith("_cpu_pct") and k != "machine_cpu_pct"
    ]
    return text + (f" (cpu: {', '.join(cpu)})" if cpu else "")


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# shardcache benchmark results",
        "",
        f"Generated by `scripts/bench` (size `{report['size']}`) on "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(report['started']))}, "
        f"{report['duration_s']:.0f} s.",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB, Linux {m['kernel']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        "",
        f"Server: moto in its own process. Its own ceiling in this run (unshaped, whole "
        f"objects, 4 client threads): **{report['server_ceiling']['mb_s']} MB/s** "
        f"(server CPU {report['server_ceiling'].get('server_cpu_pct')}%).",
        "Shaped link: a FaultProxy in its own process; "
        f"{report['link']}. Medians of {SIZES[report['size']]['reps']} repetitions; "
        "`machine_cpu_pct` is the busy share of all cores during the run, `cpu:` is per "
        "process as a % of one core (client = the benchmark process and its children; "
        "other = everything else on the machine, e.g. other jobs running at the same time).",
        "",
        "| id | scenario | shardcache | peers | ratio | target | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for sid, res in report["results"].items():
        title = SCENARIOS[sid][0]
        if "error" in res:
            lines.append(f"| {sid} | {title} | error: {res['error']} | | | | NOT RUN |")
            continue
        cores = m["cores"] or 1
        peers = "<br>".join(f"**{n}**: {_fmt(r, cores)}" for n, r in res["peers"].items()) or "-"
        ratio = res.get("ratio")
        extra = [
            f"{k}={v}"
            for k, v in res.items()
            if k in {"link_fraction", "lock_ratio", "gets_exactly_one_per_shard"}
        ]
        if "server_ranged_ceiling" in res:
            extra.append(
                f"server ranged ceiling (unshaped) {res['server_ranged_ceiling']['mb_s']} MB/s"
            )
        ratio_text = "<br>".join([*([f"{ratio}"] if ratio is not None else []), *extra]) or "-"
        lines.append(
            f"| {sid} | {title}: {res['what']} | {_fmt(res['shardcache'], cores)} | {peers} | "
            f"{ratio_text} | {res['target']} | {res['verdict']} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--only", default="", help="comma-separated scenario ids")
    parser.add_argument("--render", action="store_true", help="only rewrite results.md from .json")
    args = parser.parse_args(argv)
    if args.render:
        out = Path(args.out)
        report = json.loads((out / "results.json").read_text())
        (out / "results.md").write_text(render(report))
        return 0
    only = [s.strip().upper() for s in args.only.split(",") if s.strip()] or list(SCENARIOS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shardcache-bench-"))
    started = time.time()
    b = Bench(args.size, work)
    report: dict[str, Any] = {
        "size": args.size,
        "started": started,
        "machine": machine(),
        "link": b.cfg["link"].describe(),
        "results": {},
    }
    print(json.dumps(report["machine"]), flush=True)
    try:
        report["server_ceiling"] = server_ceiling(b)
        print("server ceiling", report["server_ceiling"], flush=True)
        for sid in only:
            t0 = time.monotonic()
            try:
                res = SCENARIOS[sid][1](b)
            except Exception as exc:  # one scenario's failure must not hide the others
                import traceback

                traceback.print_exc()
                res = {"error": f"{type(exc).__name__}: {exc}"}
            b.s3.reset()
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True, exist_ok=True)
            report["results"][sid] = res
            print(sid, f"{time.monotonic() - t0:.1f}s", json.dumps(res), flush=True)
    finally:
        b.close()
        shutil.rmtree(work, ignore_errors=True)
    report["duration_s"] = time.time() - started
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "results.md").write_text(render(report))
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    return 1 if any("error" in r for r in report["results"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
