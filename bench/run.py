"""shardcache benchmarks B1-B11 and B13-B16 against their peers; writes bench/results.{md,json}.

    python -m bench.run [--size tiny|full] [--out DIR] [--only B2,B6]
    python -m bench.run --only B14 --merge    # re-measure one scenario into results.json

Every timed scenario reports medians of several repetitions and ratios to its peer;
shaped scenarios go through a FaultProxy (own process) in front of a moto server (own
process) and report CPU use next to the numbers. Peers that are not installed in the running
venv (s3torchconnector, litdata, Mosaic Streaming: scripts/bench installs them in .venv-bench)
are reported as "not installed".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import peers, studies
from bench.b2_cold import b2_cold
from bench.b6_large import b6_large
from bench.b9_first_sample import b9_first_sample
from bench.b10_resume import b10_resume
from bench.b11_bookkeeping import b11_bookkeeping
from bench.b13_epochs import b13_epochs
from bench.b14_mixture import b14_mixture
from bench.b15_fast_server import b15_fast_server
from bench.b16_stage_check import b16_stage_check
from bench.common import (
    SIZES,
    Bench,
    clear_fs_caches,
    new_cache,
    read_shardcache,
    read_wds,
    summarise,
    timed,
    verdict,
)
from bench.infra import (
    BUCKET,
    CTX,
    MB,
    CpuMeter,
    MiB,
    env_vars,
    install_wds_s3_opener,
    machine,
    median,
    presigned,
    put,
    samples_per_shard,
)


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


def _b3_worker(kind: str, urls: list[str], so: dict[str, Any], root: str, barrier, q) -> None:  # noqa: PLR0917
    install_wds_s3_opener(so)
    if kind == "shardcache":
        cache = new_cache(Path(root), so, scope="node")
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


def b7_hiding(b: Bench) -> dict[str, Any]:
    """A consumer doing fixed per-sample work: how long it waits for data, apart from its work."""
    from bench import peers

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


def _client_cpu_s(fn: Callable[[], Any]) -> tuple[float, float]:
    """(CPU seconds of this process and its children, wall seconds) spent in ``fn``."""
    with CpuMeter({}) as meter:
        t0 = time.monotonic()
        fn()
        wall = time.monotonic() - t0
    return meter.result["client_cpu_pct"] / 100 * wall, wall


B8_FAST = " (fast server)"
S3TC = "s3torchconnector S3Client.get_object"


def _b8_readers(  # noqa: PLR0917
    b: Bench,
    so: dict[str, Any],
    boto3_client: Callable[[], Any],
    keys: list[str],
    warm: str,
    curl_args: Callable[[str], list[str]],
) -> dict[str, Callable[[], Callable[[], None]]]:
    """B8's readers against the server ``so`` points at: name -> make the client, warm it
    up, return the timed run. ``curl_args(key)``: curl's URL (and signing) for ``key``."""
    import fsspec

    def shardcache_fetch() -> Callable[[], None]:
        cache = new_cache(b.fresh_dir("b8"), so)  # verification on
        cache.fetch(f"s3://{BUCKET}/{warm}")
        return lambda: [cache.fetch(f"s3://{BUCKET}/{key}") for key in keys]

    def s3fs_fs() -> Any:
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **so)
        fs.cat_file(f"s3://{BUCKET}/{warm}")
        return fs

    def s3fs_get() -> Callable[[], None]:
        fs, dest = s3fs_fs(), b.fresh_dir("b8p")
        return lambda: [fs.get(f"s3://{BUCKET}/{key}", str(dest / key)) for key in keys]

    def s3fs_read() -> Callable[[], None]:
        fs = s3fs_fs()

        def run() -> None:
            for key in keys:
                with fs.open(f"s3://{BUCKET}/{key}", "rb", block_size=8 * MiB) as f:
                    while f.read(8 * MiB):
                        pass

        return run

    def boto3_download() -> Callable[[], None]:
        client, dest = boto3_client(), b.fresh_dir("b8p")
        client.get_object(Bucket=BUCKET, Key=warm)["Body"].read()
        return lambda: [client.download_file(BUCKET, k, str(dest / k)) for k in keys]

    def curl() -> Callable[[], None]:  # the floor: a C client writing the file, no verification
        dest = b.fresh_dir("b8p")
        return lambda: [
            subprocess.run(["curl", "-sSf", "-o", str(dest / k), *curl_args(k)], check=True)
            for k in keys
        ]

    def s3torchconnector_get() -> Callable[[], None]:
        client, dest = peers.s3torchconnector_client(so), b.fresh_dir("b8p")
        client.get_object(BUCKET, warm).read()
        return lambda: peers.s3torchconnector_fetch(client, keys, dest)

    readers: dict[str, Callable[[], Callable[[], None]]] = {
        "shardcache fetch": shardcache_fetch,
        "s3fs get": s3fs_get,
        "boto3 download_file": boto3_download,
        "s3fs streaming read (no file)": s3fs_read,
    }
    if not peers.missing(["s3torchconnector"]):
        readers[S3TC] = s3torchconnector_get
    if shutil.which("curl"):
        readers["curl -o (floor)"] = curl
    return readers


def _b8_measure(
    readers: dict[str, Callable[[], Callable[[], None]]], reps: int, gb: float
) -> dict[str, dict[str, Any]]:
    """Client CPU per GB of every reader, ``reps`` runs in alternating order, medians."""
    runs: dict[str, list[tuple[float, float]]] = {}
    for rep in range(reps):
        order = list(readers) if rep % 2 == 0 else list(reversed(readers))  # alternate
        for name in order:
            clear_fs_caches()
            run = readers[name]()
            # The reader before's files written back first: the kernel's write-back of them
            # would otherwise load the machine while this reader is measured.
            os.sync()
            runs.setdefault(name, []).append(_client_cpu_s(run))
    return {
        name: {
            "cpu_s_per_gb": round(median([cpu for cpu, _ in rs]) / gb, 2),
            "wall_s": round(median([wall for _, wall in rs]), 3),
            "reps": len(rs),
        }
        for name, rs in runs.items()
    }


def b8_cpu(b: Bench) -> dict[str, Any]:
    """Client CPU per GB of a cold fetch, every reader one object at a time, unshaped, from
    moto and from the fast server (rclone serve s3, whose client-side cost is the same work
    against a server that is not Python; the verdict takes both). On the fast server the
    objects are uploaded with a CRC64NVME checksum, as S3 stores every new object (moto's
    have the CRC32 botocore's upload sends); s3fs validates response checksums only when
    required there (``peers.NO_RANGE_CHECKSUMS``), boto3 at its default with its ranged GETs
    unchecked as on S3 (``peers.checksums_as_on_s3``).

    Each reader is prepared before the clock starts: its client made and one small warm-up
    object read through it, so no row counts a client's creation (shardcache shares
    botocore's parsed models across caches in a process; a fresh s3fs or boto3 client parses
    them again, and a training job makes its client once). s3torchconnector's CRT client
    takes its credentials from AWS_*, so they point at the server being measured."""
    from shardcache.testing import RcloneS3Server

    count, size = b.cfg["b8"]
    objects = {f"b8-{i:03d}.bin": os.urandom(size) for i in range(count)}
    warm = "b8-warm-up.bin"
    objects_and_warm = {**objects, warm: os.urandom(1024)}
    put(b.s3, objects_and_warm)
    keys = list(objects)
    gb = count * size / 1e9
    # Signed before the clock starts: curl's own work is the floor being measured.
    signer = b.s3.boto3_client()
    signed = {
        key: signer.generate_presigned_url("get_object", {"Bucket": BUCKET, "Key": key}, 3600)
        for key in keys
    }
    readers = _b8_readers(b, b.direct, b.s3.boto3_client, keys, warm, lambda k: [signed[k]])
    results = _b8_measure(readers, b.cfg["reps"], gb)
    with RcloneS3Server() as fast, env_vars(**fast.env()):
        fast.put_objects(BUCKET, objects_and_warm, checksum=peers.S3_CHECKSUM)
        config = {"response_checksum_validation": peers.NO_RANGE_CHECKSUMS}
        so = fast.storage_options() | {"config_kwargs": config}
        sigv4 = ["--aws-sigv4", f"aws:amz:{so['client_kwargs']['region_name']}:s3"]
        sigv4 += ["--user", f"{fast.access_key}:{fast.secret_key}"]

        def curl_args(key: str) -> list[str]:  # rclone refuses boto3's presigned URLs
            return [*sigv4, f"{fast.endpoint_url}/{BUCKET}/{key}"]

        def boto3_client() -> Any:
            return peers.checksums_as_on_s3(fast.boto3_client())

        readers = _b8_readers(b, so, boto3_client, keys, warm, curl_args)
        fast_results = _b8_measure(readers, b.cfg["reps"], gb)
    s = results.pop("shardcache fetch")
    fast_s = fast_results.pop("shardcache fetch")
    ratio = round(s["cpu_s_per_gb"] / results["s3fs get"]["cpu_s_per_gb"], 2)
    fast_ratio = round(fast_s["cpu_s_per_gb"] / fast_results["s3fs get"]["cpu_s_per_gb"], 2)
    s3tc, fast_s3tc = results.get(S3TC), fast_results.get(S3TC)
    s3tc_ratio = round(s["cpu_s_per_gb"] / s3tc["cpu_s_per_gb"], 2) if s3tc else None
    fast_s3tc_ratio = (
        round(fast_s["cpu_s_per_gb"] / fast_s3tc["cpu_s_per_gb"], 2) if fast_s3tc else None
    )
    results |= {name + B8_FAST: r for name, r in fast_results.items()}
    for name in (S3TC, S3TC + B8_FAST):
        results.setdefault(name, {"status": "not installed"})
    return {
        "what": f"{count} x {size / MiB:g} MiB objects fetched cold, one at a time, direct to "
        "moto, then direct to the fast server (rclone serve s3, rows marked so); client CPU "
        "(user + sys of the process, its threads and children) per GB; every reader's client "
        "made and warmed up before the clock",
        "shardcache": s | {f"fast_server_{k}": v for k, v in fast_s.items() if k != "reps"},
        "peers": results,
        "ratio": ratio,
        "fast_server_ratio": fast_ratio,
        "s3torchconnector_ratio": s3tc_ratio if s3tc else "not measured (not installed)",
        "fast_server_s3torchconnector_ratio": fast_s3tc_ratio,
        "target": "<= 0.8 x s3fs get CPU per GB and <= 1.2 x s3torchconnector, from moto and "
        "from the fast server, verification on",
        "verdict": verdict(
            max(ratio, fast_ratio) <= 0.8
            and all(r is None or r <= 1.2 for r in (s3tc_ratio, fast_s3tc_ratio))
        ),
    }


SCENARIOS: dict[str, tuple[str, Callable[[Bench], dict[str, Any]]]] = {
    "B1": ("warm cache, full WebDataset pipeline", b1_warm),
    "B2": ("cold cache over the shaped link, every peer at equal concurrency", b2_cold),
    "B3": ("processes on one node, node scope, cold", b3_node),
    "B4": ("per-call overhead", b4_overhead),
    "B5": ("memory of a large fetch", b5_memory),
    "B6": (
        "large single object over the shaped link: fast server, moto, SeaweedFS (four kinds)",
        b6_large,
    ),
    "B7": ("latency hiding at a fixed consumer rate", b7_hiding),
    "B8": ("client CPU per GB of a cold fetch", b8_cpu),
    "B9": ("time to first sample, cold", b9_first_sample),
    "B10": ("resume mid-epoch from a checkpoint, warm and cold", b10_resume),
    "B11": ("bookkeeping cost vs the number of cached shards", b11_bookkeeping),
    "B13": ("requests and bytes per epoch over 3 epochs, rank and node scope", b13_epochs),
    "B14": ("mixture throughput against one source alone, hot cache", b14_mixture),
    "B15": (
        "cold throughput against a fast server (rclone), equal objects in flight",
        b15_fast_server,
    ),
    "B16": ("stage()'s format check against plain webdataset, hot cache", b16_stage_check),
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
    if "status" in res:
        return str(res["status"])
    if "error" in res:
        return f"**ERROR**: {res['error']}"
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
        title = SCENARIOS[sid][0] if sid in SCENARIOS else res.get("title", sid)
        if "measured" in res:  # merged into the full run's file (--merge)
            at = time.strftime("%Y-%m-%d %H:%M", time.localtime(res["measured"]["started"]))
            title += f" (measured alone on {at}, load average {res['measured']['load_avg']})"
        if "error" in res:
            lines.append(f"| {sid} | {title} | error: {res['error']} | | | | NOT RUN |")
            continue
        cores = m["cores"] or 1
        peers = "<br>".join(f"**{n}**: {_fmt(r, cores)}" for n, r in res["peers"].items()) or "-"
        ratio = res.get("ratio")
        extra = [
            f"{k}={v}"
            for k, v in res.items()
            if k
            in {"link_fraction", "lock_ratio", "gets_exactly_one_per_shard", "best_peer"}
            | {"limit_mb_s", "limit_is", "s3torchconnector_ratio", "speedup_vs_naive"}
            | {"fast_server_ratio", "fast_server_s3torchconnector_ratio"}
            | {"cold_ratio", "resume_overhead_warm_s", "resume_overhead_cold_s"}
            | {"cost_pct", "cpu_ratio", "mixing_cpu_us_per_sample", "curl_ratio", "verdicts"}
            | {"cpu_ratios", "extra_cpu_us"}
        ]
        if "server_ranged_ceiling" in res:
            extra.append(
                f"server ranged ceiling (unshaped) {res['server_ranged_ceiling']['mb_s']} MB/s"
            )
        if "seaweedfs_ranged_ceiling" in res:
            ceiling = res["seaweedfs_ranged_ceiling"]["mb_s"]
            extra.append(f"SeaweedFS ranged ceiling (unshaped) {ceiling} MB/s")
        for server, fractions in res.get("link_fractions", {}).items():
            extra.append(f"{server}: " + ", ".join(f"{n} {f}" for n, f in fractions.items()))
        for how in ("", "_unshaped"):
            for kind, ratios in res.get(f"kind_ratios{how}", {}).items():
                text = ", ".join(f"{n}={v}" for n, v in ratios.items())
                extra.append(f"{kind}{how.replace('_', ' ')}: {text}")
            if vs := res.get(f"multipart_md5_vs_crc64nvme{how}"):
                extra.append(
                    f"multipart MD5 / CRC64NVME{how.replace('_', ' ')}: wall x{vs['wall']}, "
                    f"CPU x{vs['cpu']}"
                )
        ratio_text = "<br>".join([*([f"{ratio}"] if ratio is not None else []), *extra]) or "-"
        lines.append(
            f"| {sid} | {title}: {res['what']} | {_fmt(res['shardcache'], cores)} | {peers} | "
            f"{ratio_text} | {res['target']} | {res['verdict']} |"
        )
    lines.append("")
    return "\n".join(lines)


def write_report(out: Path, report: dict[str, Any]) -> None:
    """``out/results.json`` and ``out/results.md``; after a run into ``bench/`` itself, the
    benchmarks page's tables follow its figures."""
    from bench import docs_tables

    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "results.md").write_text(render(report))
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    if (out / "results.json").resolve() == docs_tables.RESULTS:
        docs_tables.main([])
        print(f"rewrote the tables of {docs_tables.PAGE} from {docs_tables.RESULTS}")


def _merge_base(out: Path, size: str, only: list[str]) -> dict[str, Any]:
    """The full run's report that ``--merge`` replaces the given scenarios in."""
    path = out / "results.json"
    if not path.is_file():
        raise SystemExit(f"--merge: {path} does not exist; run the full benchmark first")
    base = json.loads(path.read_text())
    if base["size"] != size:
        raise SystemExit(f"--merge: {path} holds a run of size {base['size']!r}, not {size!r}")
    if unknown := [sid for sid in only if sid not in SCENARIOS]:
        raise SystemExit(f"--merge: no scenario {', '.join(unknown)}")
    return base


def merge(base: dict[str, Any], fresh: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``base`` with the scenarios of ``fresh`` replaced (or added), ordered by their number
    (B12, measured by its own script, among them)."""
    results = base["results"] | fresh
    return base | {"results": {sid: results[sid] for sid in sorted(results, key=_number)}}


def _number(sid: str) -> int:
    return int(sid.removeprefix("B"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--only", default="", help="comma-separated scenario ids")
    parser.add_argument("--render", action="store_true", help="only rewrite results.md from .json")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only the --only scenarios' results in OUT/results.json, keeping the rest",
    )
    args = parser.parse_args(argv)
    if args.render:
        out = Path(args.out)
        report = json.loads((out / "results.json").read_text())
        (out / "results.md").write_text(render(report))
        return 0
    only = [s.strip().upper() for s in args.only.split(",") if s.strip()] or list(SCENARIOS)
    out = Path(args.out)
    base = _merge_base(out, args.size, only) if args.merge else None
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
            t0, at, load = time.monotonic(), time.time(), os.getloadavg()[0]
            try:
                res = SCENARIOS[sid][1](b)
            except Exception as exc:  # one scenario's failure must not hide the others
                import traceback

                traceback.print_exc()
                res = {"error": f"{type(exc).__name__}: {exc}"}
            b.s3.reset()
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True, exist_ok=True)
            if base is not None:  # when and on how busy a machine this one was measured
                res["measured"] = {"started": at, "load_avg": round(load, 2)}
            report["results"][sid] = res
            print(sid, f"{time.monotonic() - t0:.1f}s", json.dumps(res), flush=True)
    finally:
        b.close()
        shutil.rmtree(work, ignore_errors=True)
    report["duration_s"] = time.time() - started
    if base is not None:
        report = merge(base, report["results"])
    else:  # the studies (python -m bench.studies) are no scenario: keep them
        report = studies.carried_over(out / "results.json", report)
    write_report(out, report)
    failed = [s for s, r in report["results"].items() if "error" in r or r.get("row_errors")]
    if failed:
        print(f"scenarios with errors (see the table): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
