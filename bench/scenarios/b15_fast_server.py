"""B15: cold throughput against a fast S3 server, every reader with the same objects in flight.

moto (B1-B14) serves a few hundred MB/s and B2-B7 go through a 50 MB/s shaped link: the
server or the link is the limit there, so the client's own cost barely shows. Here the
server is ``rclone serve s3`` (Go, local files, SigV4, ranged GETs, MD5 ETags;
:class:`shardcache.testing.RcloneS3Server`) in its own process on loopback, unshaped: the
client's CPU per GB decides the throughput, as on a training node with a fast store.

Data: ``count`` random objects of ``size`` bytes (full: 15 x 64 MiB), plus a 1 KiB warm-up
object, uploaded by PUT with a CRC64NVME checksum, as S3 stores every new object since
2024-12 (rclone keeps such checksums in memory and returns them with
``x-amz-checksum-mode``); the same bytes again under ``md5/`` written as files, with an MD5
ETag and no checksum (objects stored before S3 kept checksums, or stores without them),
which one shardcache row reads. The server computes each object's MD5 once, before the
clock, and keeps it (S3 computes an ETag at upload; rclone alone would hash the whole object
again for every HEAD and every ranged GET, on the cores the readers use).

Requests per 64 MiB object: shardcache 4 GETs (the whole-object GET gives the size and
checksum and its body the first 16 MiB part; 3 ranged GETs; one stream: 1 GET), s3fs ``get``
3 GETs, boto3 ``download_file`` 1 HEAD + 8 ranged GETs (validating only when required:
8 ranged GETs, the first alone), s3torchconnector 8 ranged GETs, curl
1 GET (counted through a proxy before shardcache's HEAD was dropped; shardcache's own counts
are checked in ``tests/integration/testing/test_fast_server.py``).

Readers, each run in a fresh process (spawned: its imports, client and threads its own),
``inflight`` objects in flight (full: 8), objects written to files in a fresh directory:

- shardcache ``cache.prefetch(urls, threads=T)`` iterated to the end, defaults otherwise:
  verification on (the object's S3 checksum, CRC64NVME here, else the MD5 of its single-part
  ETag), and 64 MiB objects reach ``SHARDCACHE_PARALLEL_THRESHOLD`` (64M), so each is fetched
  in 4 parts of 16 MiB (up to 8 per object in flight); also with ``SHARDCACHE_VERIFY=size``,
  with one stream per object (the threshold above the size: exactly T connections, as every
  peer), and reading the copies without a checksum (verified by the ETag's MD5).
- s3fs ``fs.get(list, list, batch_size=T)`` on one instance (batched: 8 threads each calling
  ``get`` on one s3fs instance crawled here, see ENVIRONMENT.md).
- boto3 ``download_file`` on a pool of T threads, one shared client, default TransferConfig
  (objects above 8 MiB in 8 MiB parts, 10 threads each) and client config.
- Checksums: rclone returns the whole object's checksum with a ranged GET too, where S3
  returns none, and botocore's default (``when_supported``) then checks each part against
  it and fails. s3fs validates only when required (``peers.NO_RANGE_CHECKSUMS``: on S3 its
  ranged parts go unchecked, as here, and its whole-object GETs would be checked, CRC64NVME
  with awscrt, about 0.15 s/GB more). boto3 keeps its default, with its ranged GETs left
  unchecked as on S3 (``peers.checksums_as_on_s3``); a second boto3 row validates only
  when required, with which s3transfer reads an object's first part alone before asking for
  the others (its path without a HEAD). The best peer is the faster of the two.
- s3torchconnector 1.5.0 ``S3Client.get_object`` on a pool of T threads, each body copied to
  its file (its CRT client takes its credentials from AWS_*, set to the fast server's).
- awscrt's ``S3Client`` (the CRT transport behind boto3's crt mode and s3torchconnector),
  T objects at a time, each written by the CRT straight to its file: what a native transport
  would give shardcache (issue 29 asks whether one pays). A reference row, not a peer.
- curl, one process per object, T at a time, ``--aws-sigv4`` (the floor: a C client writing
  the file, no verification).

A run that does not finish within ``timeout`` is killed and its row reads "hangs" (an
earlier probe saw s3torchconnector's CRT client hang against rclone; with its credentials
pointing at rclone it works). Before the clock each reader makes its client and reads the
warm-up object through it (a training job makes its client once). Timed: from the first
request to the last byte on disk; ``cpu_s_per_gb`` is the reader process's user + system CPU
in that window (its threads and waited children: curl), per GB of objects; the same window
gives the machine's busy share of all cores and the server's CPU (``server_cpu_s_per_gb``:
what this reader's requests cost the server). Every run's files must
have the objects' sizes, else the row is an error. Medians of ``reps`` runs, the readers'
order alternated; ``mb_s_runs`` keeps every run's figure.

Targets (issue 29, verification on): throughput >= 1.0x the best peer's (the fastest of
s3fs, boto3 and s3torchconnector), client CPU per GB <= 1.0x that peer's, throughput >=
0.6x curl's.
"""

from __future__ import annotations

import os
import queue
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.support import peers
from bench.support.common import Bench, verdict
from bench.support.infra import CTX, MiB, _machine_busy, _proc_cpu, median

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"count": 4, "size": 256 * 1024, "inflight": 2, "reps": 1, "timeout": 60.0},
    "full": {"count": 15, "size": 64 * MiB, "inflight": 8, "reps": 5, "timeout": 90.0},
}
BUCKET = "b15"
WARM = "warm-up.bin"
SC = "shardcache"
PEERS = ("s3fs", "boto3", "s3torchconnector")  # the best of these is "the best peer"
NOT_INSTALLED = "not installed"
MD5_ONLY = "B15_MD5_ONLY"  # a row's marker: read the copies stored without a checksum
WHEN_REQUIRED = "B15_WHEN_REQUIRED"  # a boto3 row's marker: validate only when required


def _rows(t: int, size: int) -> dict[str, tuple[str, dict[str, str]]]:
    """Row name -> (reader kind, environment of its process; ``MD5_ONLY``: read the objects
    that have no S3 checksum)."""
    return {
        SC: ("shardcache", {}),
        "shardcache, SHARDCACHE_VERIFY=size": ("shardcache", {"SHARDCACHE_VERIFY": "size"}),
        "shardcache, one stream per object": (
            "shardcache",
            {"SHARDCACHE_PARALLEL_THRESHOLD": str(2 * size)},
        ),
        "shardcache, objects without an S3 checksum (verified by the ETag's MD5)": (
            "shardcache",
            {MD5_ONLY: "1"},
        ),
        f"s3fs get(list, list), batch_size={t}": ("s3fs", {}),
        f"boto3 download_file, {t} threads": ("boto3", {}),
        f"boto3 download_file, {t} threads, response_checksum_validation=when_required": (
            "boto3",
            {WHEN_REQUIRED: "1"},
        ),
        f"s3torchconnector S3Client.get_object, {t} threads": ("s3torchconnector", {}),
        f"awscrt S3Client, {t} at a time, writing straight to the file": ("awscrt", {}),
        f"curl --aws-sigv4, {t} at a time (floor)": ("curl", {}),
    }


# ---------------------------------------------------------------------------- the readers
def _reader(
    kind: str, so: dict[str, Any], keys: list[str], dest: Path, t: int
) -> Callable[[], list[Path]]:
    """Make ``kind``'s client, read the warm-up object through it, return the timed run."""
    urls = [f"s3://{BUCKET}/{k}" for k in keys]
    files = [dest / "out" / k.replace("/", "_") for k in keys]
    files[0].parent.mkdir(parents=True, exist_ok=True)
    if kind == "shardcache":
        from shardcache import ShardCache

        cache = ShardCache(dest / "cache", storage_options=so)
        cache.fetch(f"s3://{BUCKET}/{WARM}")
        return lambda: [path for _, path in cache.prefetch(urls, threads=t)]
    if kind == "s3fs":
        import fsspec

        config = {"response_checksum_validation": peers.NO_RANGE_CHECKSUMS}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config, **so)
        fs.cat_file(f"s3://{BUCKET}/{WARM}")

        def get_all() -> list[Path]:
            fs.get(urls, [str(f) for f in files], batch_size=t)
            return files

        return get_all
    if kind == "boto3":
        client = _boto3_client(so, when_required=bool(os.environ.pop(WHEN_REQUIRED, None)))
        client.get_object(Bucket=BUCKET, Key=WARM)["Body"].read()
        return lambda: _pool(t, lambda k, f: client.download_file(BUCKET, k, str(f)), keys, files)
    if kind == "s3torchconnector":
        client = peers.s3torchconnector_client(so)
        client.get_object(BUCKET, WARM).read()

        def get(key: str, path: Path) -> None:
            with open(path, "wb") as out:
                shutil.copyfileobj(client.get_object(BUCKET, key), out, 8 << 20)

        return lambda: _pool(t, get, keys, files)
    if kind == "awscrt":
        return _awscrt_reader(so, keys, files, t)
    if kind == "curl":
        sigv4 = ["--aws-sigv4", f"aws:amz:{so['client_kwargs']['region_name']}:s3"]
        sigv4 += ["--user", f"{so['key']}:{so['secret']}"]
        base = so["endpoint_url"]

        def curl(key: str, path: Path) -> None:
            cmd = ["curl", "-sSf", *sigv4, "-o", str(path), f"{base}/{BUCKET}/{key}"]
            subprocess.run(cmd, check=True)

        curl(WARM, dest / "warm")
        return lambda: _pool(t, curl, keys, files)
    raise ValueError(kind)


def _awscrt_reader(
    so: dict[str, Any], keys: list[str], files: list[Path], t: int
) -> Callable[[], list[Path]]:
    """The AWS CRT's own S3 client (the transport of boto3's crt mode and s3torchconnector),
    each object written by it straight to its file (``recv_filepath``), response checksums
    validated where it checks them; ``t`` objects at a time."""
    from urllib.parse import urlparse

    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3ChecksumConfig, S3Client, S3RequestTlsMode, S3RequestType

    loops = EventLoopGroup()
    client = S3Client(
        bootstrap=ClientBootstrap(loops, DefaultHostResolver(loops)),
        region=so["client_kwargs"]["region_name"],
        credential_provider=AwsCredentialsProvider.new_static(so["key"], so["secret"]),
        tls_mode=S3RequestTlsMode.DISABLED,  # the endpoint is plain http on loopback
    )
    host = urlparse(so["endpoint_url"]).netloc

    def get(key: str, path: Path) -> None:
        request = HttpRequest("GET", f"/{BUCKET}/{key}", HttpHeaders([("Host", host)]))
        done = client.make_request(
            type=S3RequestType.GET_OBJECT,
            request=request,
            recv_filepath=str(path),
            checksum_config=S3ChecksumConfig(validate_response=True),
        ).finished_future
        done.result(timeout=120)

    get(WARM, files[0].parent / "warm")
    return lambda: _pool(t, get, keys, files)


def _boto3_client(so: dict[str, Any], *, when_required: bool) -> Any:
    """boto3's client at its default checksum validation (its ranged GETs unchecked, as on
    S3), or validating only when required (``when_required``)."""
    import boto3
    from botocore.config import Config

    checks = {"response_checksum_validation": peers.NO_RANGE_CHECKSUMS} if when_required else {}
    client = boto3.client(
        "s3",
        endpoint_url=so["endpoint_url"],
        aws_access_key_id=so["key"],
        aws_secret_access_key=so["secret"],
        region_name=so["client_kwargs"]["region_name"],
        config=Config(s3={"addressing_style": "path"}, **checks),
    )
    return client if when_required else peers.checksums_as_on_s3(client)


def _pool(
    t: int, get: Callable[[str, Path], Any], keys: list[str], files: list[Path]
) -> list[Path]:
    """``get(key, file)`` of every object on ``t`` threads; returns the files."""
    with ThreadPoolExecutor(t) as pool:
        list(pool.map(get, keys, files))
    return files


def _cpu() -> float:
    """User + system CPU seconds of this process, its threads and its waited children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _child(kind: str, env: dict[str, str], job: dict[str, Any], q: Any) -> None:
    """One run of one reader in a fresh process; puts its figures (or its error) on ``q``.
    AWS_* point at the fast server (the Bench's point at moto): s3torchconnector's CRT client
    takes its credentials from them, not from the storage options."""
    os.environ.update(job["aws_env"] | env)
    keys = [f"md5/{k}" for k in job["keys"]] if os.environ.pop(MD5_ONLY, None) else job["keys"]
    try:
        run = _reader(kind, job["so"], keys, Path(job["dest"]), job["inflight"])
        busy0, cpu0, server0 = _machine_busy(), _cpu(), _proc_cpu(job["server_pid"])
        t0 = time.monotonic()
        paths = run()
        wall = time.monotonic() - t0
        cpu, busy, server = _cpu() - cpu0, _machine_busy(), _proc_cpu(job["server_pid"])
        sizes = [os.path.getsize(p) for p in paths]
        if sizes != [job["size"]] * len(keys):
            raise RuntimeError(f"files of {sizes} bytes, expected {job['size']} each")
        q.put(
            {
                "wall": wall,
                "cpu": cpu,
                "server_cpu": server - server0,
                "machine_cpu_pct": 100 * (busy[0] - busy0[0]) / max(busy[1] - busy0[1], 1),
                "server_cpu_pct": 100 * (server - server0) / wall,
                "client_cpu_pct": 100 * cpu / wall,
            }
        )
    except peers.PeerMissing as exc:
        q.put({"status": f"{NOT_INSTALLED} ({exc})"})
    except Exception as exc:  # reported in the row
        q.put({"error": f"{type(exc).__name__}: {exc}"})


def _run(kind: str, env: dict[str, str], job: dict[str, Any], timeout: float) -> dict[str, Any]:
    q = CTX.Queue()
    proc = CTX.Process(target=_child, args=(kind, env, job, q), daemon=True)
    proc.start()
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return {"status": f"hangs (no result within {timeout:g} s; killed)"}
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _missing(kind: str) -> str | None:
    if kind == "curl" and shutil.which("curl") is None:
        return f"{NOT_INSTALLED} (no curl on PATH)"
    module = {"s3fs": "s3fs", "boto3": "boto3", "s3torchconnector": "s3torchconnector"}.get(kind)
    if module and peers.missing([module]):
        return f"{NOT_INSTALLED} ({module})"
    return None


def _summary(runs: list[dict[str, Any]], gb: float) -> dict[str, Any]:
    wall = median([r["wall"] for r in runs])
    return {
        "mb_s": round(gb * 1000 / wall, 1),
        "cpu_s_per_gb": round(median([r["cpu"] for r in runs]) / gb, 2),
        "server_cpu_s_per_gb": round(median([r["server_cpu"] for r in runs]) / gb, 2),
        "wall_s": round(wall, 3),
        "mb_s_runs": [round(gb * 1000 / r["wall"], 1) for r in runs],
        "reps": len(runs),
        **{
            key: round(median([r[key] for r in runs]), 1)
            for key in ("machine_cpu_pct", "client_cpu_pct", "server_cpu_pct")
        },
    }


def _measure(
    b: Bench, server: Any, rows: dict[str, tuple[str, dict[str, str]]], keys: list[str], cfg: dict
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], dict[str, str]]:
    """Every row's runs (``reps`` each, order alternated), and the rows that could not run
    (name -> status: not installed, hangs) or failed (name -> error)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    statuses = {name: why for name, (kind, _) in rows.items() if (why := _missing(kind))}
    errors: dict[str, str] = {}
    for rep in range(cfg["reps"]):
        order = list(rows) if rep % 2 == 0 else list(reversed(rows))  # alternate
        for name in order:
            if name in statuses or name in errors:
                continue
            kind, env = rows[name]
            dest = b.fresh_dir("b15")
            job = {"so": server.storage_options(), "aws_env": server.env(), "keys": keys}
            job |= {"dest": str(dest), "inflight": cfg["inflight"], "size": cfg["size"]}
            job["server_pid"] = server.pid
            res = _run(kind, env, job, cfg["timeout"])
            shutil.rmtree(dest, ignore_errors=True)  # outside the clock: disk and dirty pages
            if "status" in res:
                statuses[name] = res["status"]
            elif "error" in res:
                errors[name] = res["error"]
                print(f"B15 row {name!r} FAILED: {res['error']}", file=sys.stderr, flush=True)
            else:
                runs[name].append(res)
            print(f"B15 row {name!r} rep {rep}: done", file=sys.stderr, flush=True)  # progress
    return runs, statuses, errors


# ---------------------------------------------------------------------------- the scenario
def b15_fast_server(b: Bench) -> dict[str, Any]:
    from shardcache.testing import RcloneS3Server

    cfg = SIZES[b.size]
    count, size, t = cfg["count"], cfg["size"], cfg["inflight"]
    rows = _rows(t, size)
    keys = [f"obj-{i:03d}.bin" for i in range(count)]
    gb = count * size / 1e9
    load_before = os.getloadavg()
    with RcloneS3Server() as server:
        server.put_objects(BUCKET, {WARM: os.urandom(1024)}, checksum=peers.S3_CHECKSUM)
        for key in keys:  # one at a time: the bench never holds them all
            data = os.urandom(size)
            server.put_objects(
                BUCKET, {key: data}, checksum=peers.S3_CHECKSUM
            )  # uploaded, as on S3
            server.put_objects(BUCKET, {f"md5/{key}": data})  # a file: MD5 ETag, no checksum
        runs, statuses, errors = _measure(b, server, rows, keys, cfg)
    results: dict[str, Any] = {}
    for name in rows:
        if name in errors:
            results[name] = {"error": errors[name]}
        elif name in statuses:
            results[name] = {"status": statuses[name]}
        else:
            results[name] = _summary(runs[name], gb)
    s = results.pop(SC)
    measured = {n: r for n, r in results.items() if "mb_s" in r}
    peer_rows = {n: r for n, r in measured.items() if rows[n][0] in PEERS}
    best = max(peer_rows, key=lambda n: peer_rows[n]["mb_s"]) if peer_rows else None
    curl = next((r for n, r in measured.items() if rows[n][0] == "curl"), None)
    out: dict[str, Any] = {
        "what": f"{count} x {size / MiB:g} MiB objects, cold, {t} in flight for every reader, "
        "each reader in a fresh process (client made and warmed up before the clock), "
        "unshaped, server: rclone serve s3 (own process, loopback, MD5 ETags, objects "
        f"uploaded with {peers.S3_CHECKSUM} checksums as S3 stores new objects; one row reads "
        "copies without a checksum); mb_s = "
        "object bytes / wall, cpu_s_per_gb = the reader process's CPU (threads, children) "
        f"per GB; load average before: {', '.join(f'{x:.2f}' for x in load_before)}",
        "shardcache": s,
        "peers": results,
        "best_peer": best,
        "row_errors": errors,
        "target": f">= 1.0x the best peer's MB/s, CPU/GB <= 1.0x the best peer's, >= 0.6x "
        f"curl's MB/s (verification on; peers: {', '.join(PEERS)})",
    }
    if "mb_s" not in s:
        return out | {"ratio": None, "verdict": verdict(False)}
    ratio = s["mb_s"] / peer_rows[best]["mb_s"] if best else None
    cpu_ratio = s["cpu_s_per_gb"] / peer_rows[best]["cpu_s_per_gb"] if best else None
    curl_ratio = s["mb_s"] / curl["mb_s"] if curl else None
    checks = {
        "throughput": ratio is None or ratio >= 1.0,
        "cpu": cpu_ratio is None or cpu_ratio <= 1.0,
        "curl": curl_ratio is None or curl_ratio >= 0.6,
    }
    return out | {
        "ratio": round(ratio, 2) if ratio else None,
        "cpu_ratio": round(cpu_ratio, 2) if cpu_ratio else None,
        "curl_ratio": round(curl_ratio, 2) if curl_ratio else None,
        "verdicts": {k: verdict(v) for k, v in checks.items()},
        "verdict": verdict(all(checks.values()) and not errors),
    }
