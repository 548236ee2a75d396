"""B6: one large object over the shaped link, fetched in ranged parts.

The same object (full: 96 MiB, 12 MiB parts x 8 in flight, for shardcache and boto3 alike)
through the same shaped link from two servers:

- **the fast server** (``rclone serve s3``: ranged GETs served from the file), which gives
  the verdict: the object uploaded with a CRC64NVME checksum, as S3 stores every new object
  (shardcache verifies the parts' CRCs, combined), and the same bytes stored as a file, with
  an MD5 ETag and no checksum, as objects stored before S3 kept checksums (shardcache hashes
  the MD5 in order while the parts land; its tail is hashed after the last part);
- **moto**, as before: it copies the whole object for every ranged GET and answers them one
  after another, about 70 ms each here, so the eighth part's first byte comes about 0.5 s
  after the first, and no client fills the link from it (boto3 included). Its rows are kept
  to show that; its rows report the GETs each reader sent (moto counts them).

Peers: s3fs ``get`` (one stream, validating response checksums only when required:
``peers.NO_RANGE_CHECKSUMS``) and boto3 ``download_file`` with TransferConfig's documented
knobs for a parallel download set to shardcache's part size and count, its checksum
validation at its default, its ranged parts left unchecked as on S3
(``peers.checksums_as_on_s3``: rclone returns the whole object's checksum with a ranged GET,
where S3 returns none).

Target: shardcache >= 90% of min(link capacity, the server's ranged ceiling) from the fast
server, for the object with a checksum (what S3 stores today).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench import peers
from bench.b2_cold import link_capacity
from bench.common import Bench, clear_fs_caches, new_cache, summarise, timed, verdict
from bench.infra import BUCKET, MB, Link, MiB, put, shaped_proxy

KEY = "b6-big.bin"
MD5_KEY = "md5/b6-big.bin"  # the same bytes with an MD5 ETag and no S3 checksum
PARTS = 8
SHARDCACHE = "shardcache"
S3FS = "s3fs get (one stream)"
BOTO3 = f"boto3 download_file ({PARTS} parts in flight)"


def _ranged_ceiling(b: Bench, server: Any, pid: int, key: str) -> dict[str, Any]:
    """The server's own ceiling for this access pattern: plain boto3 ranged GETs of the same
    parts, ``PARTS`` in flight, unshaped, bodies read into memory (no file, no checks)."""
    size, part, _thr = b.cfg["b6"]
    client = peers.checksums_as_on_s3(server.boto3_client(max_pool_connections=PARTS))
    ranges = [(a, min(a + part, size) - 1) for a in range(0, size, part)]

    def get(r: tuple[int, int]) -> int:
        body = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={r[0]}-{r[1]}")["Body"]
        return len(body.read())

    runs = []
    for _ in range(b.cfg["reps"]):
        with ThreadPoolExecutor(PARTS) as pool:
            runs.append(timed(lambda: sum(pool.map(get, ranges)), {"server": pid}))
        if runs[-1]["out"] != size:
            raise RuntimeError(f"ranged GETs returned {runs[-1]['out']} bytes, expected {size}")
    return summarise(runs, size)


def _over_the_link(
    b: Bench, server: Any, pid: int, key: str, *, count_gets: bool
) -> dict[str, dict[str, Any]]:
    """Every reader fetching ``key`` from ``server`` (process ``pid``) through the shaped
    link, ``reps`` runs each in alternating order: their summaries (with the GETs each sent,
    where counted)."""
    import fsspec
    from boto3.s3.transfer import TransferConfig

    obj, part, thr = b.cfg["b6"]
    url = f"s3://{BUCKET}/{key}"
    config = {"response_checksum_validation": peers.NO_RANGE_CHECKSUMS}
    runs: dict[str, list[dict[str, Any]]] = {}
    gets: dict[str, int] = {}
    with shaped_proxy(server.port, b.cfg["link"]) as (endpoint, proxy_pid):
        so = server.storage_options(endpoint)
        pids = {"server": pid, "proxy": proxy_pid}

        def sc() -> Any:
            cache = new_cache(b.fresh_dir("b6"), so, part_size=part, parallel_threshold=thr)
            return cache.fetch(url)

        def s3fs_get() -> Any:
            fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config, **so)
            return fs.get(url, str(b.fresh_dir("b6p") / "x.bin"))

        # boto3's documented knobs for a parallel download: TransferConfig's
        # multipart_chunksize and max_concurrency, set to shardcache's part size and count.
        transfer = TransferConfig(
            multipart_threshold=thr, multipart_chunksize=part, max_concurrency=PARTS
        )
        client = server.boto3_client(endpoint, max_pool_connections=PARTS)
        peers.checksums_as_on_s3(client)

        def boto3_download() -> Any:
            dest = str(b.fresh_dir("b6p") / "x.bin")
            return client.download_file(BUCKET, key, dest, Config=transfer)

        readers: dict[str, Callable[[], Any]] = {
            SHARDCACHE: sc,
            S3FS: s3fs_get,
            BOTO3: boto3_download,
        }
        for rep in range(b.cfg["reps"]):
            order = list(readers) if rep % 2 == 0 else list(reversed(readers))  # alternate
            for name in order:
                clear_fs_caches()
                if count_gets:
                    server.clear_requests()
                runs.setdefault(name, []).append(timed(readers[name], pids))
                if count_gets:
                    gets[name] = sum(1 for r in server.requests("GET") if r.key == key)
    summaries = {n: summarise(r, obj) for n, r in runs.items()}
    return {n: r | ({"gets": gets[n]} if n in gets else {}) for n, r in summaries.items()}


def _fractions(
    readers: dict[str, dict[str, Any]], link: Link, ceiling: dict[str, Any]
) -> tuple[float, dict[str, float]]:
    """The limit (MB/s) and each reader's share of it."""
    limit = min(link_capacity(link, PARTS) / MB, ceiling["mb_s"])
    return limit, {n: round(r["mb_s"] / limit, 3) for n, r in readers.items()}


def b6_large(b: Bench) -> dict[str, Any]:
    from shardcache.testing import RcloneS3Server

    obj, part, _thr = b.cfg["b6"]
    link: Link = b.cfg["link"]
    data = os.urandom(obj)
    put(b.s3, {KEY: data})
    moto_ceiling = _ranged_ceiling(b, b.s3, b.server_pid, KEY)
    moto = _over_the_link(b, b.s3, b.server_pid, KEY, count_gets=True)
    with RcloneS3Server() as fast:
        fast.put_objects(BUCKET, {KEY: data}, checksum=peers.S3_CHECKSUM)
        fast.put_objects(BUCKET, {MD5_KEY: data})
        del data
        ceiling = _ranged_ceiling(b, fast, fast.pid, KEY)
        crc = _over_the_link(b, fast, fast.pid, KEY, count_gets=False)
        md5 = _over_the_link(b, fast, fast.pid, MD5_KEY, count_gets=False)
    limit, frac = _fractions(crc, link, ceiling)
    _, md5_frac = _fractions(md5, link, ceiling)
    moto_limit, moto_frac = _fractions(moto, link, moto_ceiling)
    s = crc.pop(SHARDCACHE)
    peer_rows = {f"{n} (fast server)": r for n, r in crc.items()}
    peer_rows |= {f"{n} (fast server, MD5 ETag only)": r for n, r in md5.items()}
    peer_rows |= {f"{n} (moto)": r for n, r in moto.items()}
    return {
        "what": f"one {obj / MiB:g} MiB object, {part / MiB:g} MiB parts x {PARTS} in flight, "
        f"link: {link.describe()}; from the fast server (rclone serve s3) uploaded with a "
        f"{peers.S3_CHECKSUM} checksum (the verdict), the same bytes with an MD5 ETag only, "
        "and from moto, which copies the whole object for every ranged GET and answers them "
        "one after another (no client fills the link from it); each server's ranged "
        "ceiling measured in this run (plain boto3 ranged GETs of the same parts, unshaped)",
        "shardcache": s,
        "peers": peer_rows,
        "server_ranged_ceiling": ceiling,
        "moto_ranged_ceiling": moto_ceiling,
        "limit_mb_s": round(limit, 2),
        "limit_is": "link" if limit < ceiling["mb_s"] else "server",
        "ratio": round(s["mb_s"] / crc[S3FS]["mb_s"], 2),
        "link_fraction": frac[SHARDCACHE],
        "link_fractions": {
            "fast server": frac,
            "fast server, MD5 ETag only": md5_frac,
            f"moto (limit {moto_limit:.1f} MB/s)": moto_frac,
        },
        "target": ">= 90% of min(link capacity, server ranged ceiling), from the fast server",
        "verdict": verdict(frac[SHARDCACHE] >= 0.9),
    }
