"""B8: client CPU per GB of a cold fetch, from moto and from a fast server (rclone)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

from bench.support import peers
from bench.support.common import Bench, clear_fs_caches, new_cache, verdict
from bench.support.infra import BUCKET, CpuMeter, MiB, env_vars, median, put


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
