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
  to show that.
- **SeaweedFS** (``weed server -s3``), four kinds of object of the same bytes, uploaded in
  parts of the readers' part size where they are multipart (SeaweedFS refuses parts under
  5 MiB but the last, hence tiny's own size): one PUT with a full-object CRC64NVME (what S3
  stores of every new object), one PUT without a checksum (an MD5 ETag), a multipart upload
  without additional checksums (ETag ``<MD5 of the parts' MD5s>-N``, as every multipart
  upload before 2024-12) and one with a COMPOSITE CRC32C (``<CRC32C of the parts'
  CRC32Cs>-N``). rclone holds neither of the multipart kinds (it answers the upload with the
  ``-N`` ETag, then serves the file's MD5 and ignores ``PartNumber``; its UploadPart returns
  no checksum), so all four kinds are read from SeaweedFS, to be compared with each other.
  shardcache verifies each by what it is (its record's ``verified``, checked here:
  crc64nvme, md5, md5-parts, crc32c-parts); boto3 verifies none of them (its ranged parts
  carry no checksum) and is measured without and with an MD5 pass of its own over the file
  after the download (:func:`bench.support.peers.md5_pass`: the ETag, single-part or of the parts).

  The four kinds are read again straight from the server (unshaped, loopback), where the
  client's CPU, not the link, sets the pace.

Each reader makes its client and reads a 1 KiB warm-up object through it before the clock
(a training job makes its client once; until 2026-11-28 B6 timed shardcache's and s3fs's
client creation too). Every row reports its client CPU per GB next to the wall time (over
the link the cost of an MD5 shows in the CPU more than in the wall time) and, through the
link, the requests each reader sent (counted by the shaping proxy: GETs, HEADs).

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

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.scenarios.b2_cold import link_capacity
from bench.support import peers
from bench.support.common import Bench, clear_fs_caches, new_cache, summarise, timed, verdict
from bench.support.infra import BUCKET, MB, Link, MiB, median, put, shaped_proxy

KEY = "b6-big.bin"
MD5_KEY = "md5/b6-big.bin"  # the same bytes with an MD5 ETag and no S3 checksum
WARM = "warm-up.bin"  # 1 KiB each reader reads before the clock
PARTS = 8
SHARDCACHE = "shardcache"
S3FS = "s3fs get (one stream)"
BOTO3 = f"boto3 download_file ({PARTS} parts in flight)"
BOTO3_MD5 = f"{BOTO3} + its own MD5 pass"
ALL_READERS = (SHARDCACHE, S3FS, BOTO3)
# SeaweedFS's four kinds of object: kind -> (key, what shardcache's record says it verified)
KINDS: dict[str, tuple[str, str]] = {
    "full-object CRC64NVME": ("kinds/crc64nvme.bin", "crc64nvme"),
    "single-part MD5": ("kinds/md5.bin", "md5"),
    "multipart MD5": ("kinds/md5-multipart.bin", "md5-parts"),
    "composite CRC32C": ("kinds/crc32c-composite.bin", "crc32c-parts"),
}
KIND_READERS = (SHARDCACHE, BOTO3, BOTO3_MD5)
Config = tuple[int, int, int]  # object size, part size, parallel threshold


def _ranged_ceiling(b: Bench, server: Any, pid: int, key: str, cfg: Config) -> dict[str, Any]:
    """The server's own ceiling for this access pattern: plain boto3 ranged GETs of the same
    parts, ``PARTS`` in flight, unshaped, bodies read into memory (no file, no checks)."""
    size, part, _thr = cfg
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


def _over_the_link(  # noqa: PLR0917
    b: Bench,
    server: Any,
    pid: int,
    key: str,
    cfg: Config,
    readers: tuple[str, ...] = ALL_READERS,
    etag: str = "",
    *,
    direct: bool = False,
) -> dict[str, dict[str, Any]]:
    """``readers`` fetching ``key`` (ETag ``etag``, for an MD5 pass) from ``server``
    (process ``pid``) through the shaped link (``direct``: straight from the server),
    ``reps`` runs each in alternating order: their summaries, with what shardcache's record
    says it verified and, through the link, the requests each sent (counted there)."""
    import fsspec
    from boto3.s3.transfer import TransferConfig

    from shardcache._disk.metadata import read_meta

    obj, part, thr = cfg
    url = f"s3://{BUCKET}/{key}"
    config = {"response_checksum_validation": peers.NO_RANGE_CHECKSUMS}
    runs: dict[str, list[dict[str, Any]]] = {}
    sent: dict[str, dict[str, int]] = {}
    verified: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        link = None if direct else stack.enter_context(shaped_proxy(server.port, b.cfg["link"]))
        endpoint = server.endpoint_url if link is None else link.endpoint
        so = server.storage_options(endpoint)
        pids = {"server": pid} | ({} if link is None else {"proxy": link.pid})

        def requests() -> dict[str, int]:
            return {} if link is None else _requests(link.requests(), key)

        # Each reader's client is made and reads the warm-up object before the clock (a
        # training job makes its client once); the returned callable is timed.
        def sc() -> Callable[[], Any]:
            cache = new_cache(b.fresh_dir("b6"), so, part_size=part, parallel_threshold=thr)
            cache.fetch(f"s3://{BUCKET}/{WARM}")
            return lambda: (cache.layout, cache.fetch(url))

        def s3fs_get() -> Callable[[], Any]:
            fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs=config, **so)
            fs.cat_file(f"s3://{BUCKET}/{WARM}")
            return lambda: fs.get(url, str(b.fresh_dir("b6p") / "x.bin"))

        # boto3's documented knobs for a parallel download: TransferConfig's
        # multipart_chunksize and max_concurrency, set to shardcache's part size and count.
        transfer = TransferConfig(
            multipart_threshold=thr, multipart_chunksize=part, max_concurrency=PARTS
        )

        def boto3_download(md5: bool = False) -> Callable[[], Any]:
            client = server.boto3_client(endpoint, max_pool_connections=PARTS)
            peers.checksums_as_on_s3(client)
            client.get_object(Bucket=BUCKET, Key=WARM)["Body"].read()
            dest = str(b.fresh_dir("b6p") / "x.bin")

            def run() -> None:
                client.download_file(BUCKET, key, dest, Config=transfer)
                if md5:
                    peers.md5_pass(dest, etag, part)

            return run

        every: dict[str, Callable[[], Callable[[], Any]]] = {
            SHARDCACHE: sc,
            S3FS: s3fs_get,
            BOTO3: boto3_download,
            BOTO3_MD5: lambda: boto3_download(md5=True),
        }
        for rep in range(b.cfg["reps"]):
            order = list(readers) if rep % 2 == 0 else list(reversed(readers))  # alternate
            for name in order:
                clear_fs_caches()
                ready = every[name]()
                before = requests()
                run = timed(ready, pids)
                runs.setdefault(name, []).append(run)
                after = requests()
                sent[name] = {m: n - before.get(m, 0) for m, n in after.items()}
                if name == SHARDCACHE:
                    verified[name] = read_meta(*run["out"])["verified"]
    return {
        n: _summary(r, obj)
        | ({} if direct else {"gets": sent[n].get("GET", 0), "heads": sent[n].get("HEAD", 0)})
        | ({"verified": verified[n]} if n in verified else {})
        for n, r in runs.items()
    }


def _requests(seen: dict[tuple[str, str], int], key: str) -> dict[str, int]:
    """Method -> the requests about ``key`` among the proxy's ``seen``."""
    out: dict[str, int] = {}
    for (method, path), n in seen.items():
        if path == f"/{BUCKET}/{key}":
            out[method] = out.get(method, 0) + n
    return out


def _summary(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """:func:`summarise` plus the client's CPU seconds per GB (median over the runs)."""
    cpu = median([r["client_cpu_pct"] * r["wall"] / 100 for r in runs])
    return summarise(runs, nbytes) | {"cpu_s_per_gb": round(cpu / (nbytes / 1e9), 2)}


def _fractions(
    readers: dict[str, dict[str, Any]], link: Link, ceiling: dict[str, Any]
) -> tuple[float, dict[str, float]]:
    """The limit (MB/s) and each reader's share of it."""
    limit = min(link_capacity(link, PARTS) / MB, ceiling["mb_s"])
    return limit, {n: round(r["mb_s"] / limit, 3) for n, r in readers.items()}


def _put_kinds(server: Any, data: bytes, part: int) -> dict[str, str]:
    """The same ``data`` stored as each of :data:`KINDS` (multipart ones in parts of
    ``part`` bytes); returns key -> ETag."""
    (crc, _), (md5, _), (multipart, _), (composite, _) = KINDS.values()
    etags = server.put_objects(BUCKET, {crc: data}, checksum=peers.S3_CHECKSUM)
    etags |= server.put_objects(BUCKET, {md5: data, WARM: os.urandom(1024)})
    for key, checksum in ((multipart, None), (composite, "CRC32C")):
        kind = "COMPOSITE" if checksum else None
        answer = server.put_multipart(
            BUCKET, key, data, part, checksum=checksum, checksum_type=kind
        )
        etags[key] = answer["ETag"].strip('"')
    return etags


def _kinds(b: Bench) -> dict[str, Any]:
    """The four kinds of object from SeaweedFS, through the shaped link and unshaped: each
    reader's summary by kind, the server's ranged ceiling, and the ratios."""
    from shardcache.testing import SeaweedS3Server

    cfg: Config = b.cfg["b6_kinds"]
    obj, part, _thr = cfg
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    direct: dict[str, dict[str, dict[str, Any]]] = {}
    with SeaweedS3Server() as server:
        etags = _put_kinds(server, os.urandom(obj), part)
        crc_key = KINDS["full-object CRC64NVME"][0]
        ceiling = _ranged_ceiling(b, server, server.pid, crc_key, cfg)
        for kind, (key, _) in KINDS.items():
            for out, unshaped in ((rows, False), (direct, True)):
                out[kind] = _over_the_link(
                    b, server, server.pid, key, cfg, KIND_READERS, etags[key], direct=unshaped
                )
    for kind, (_, method) in KINDS.items():
        for seen in (rows[kind][SHARDCACHE]["verified"], direct[kind][SHARDCACHE]["verified"]):
            if seen != method:
                raise RuntimeError(
                    f"B6 {kind}: shardcache's record says verified by {seen!r}, expected {method!r}"
                )
    return {
        "rows": rows,
        "direct": direct,
        "ceiling": ceiling,
        "ratios": {kind: _kind_ratios(r) for kind, r in rows.items()},
        "direct_ratios": {kind: _kind_ratios(r) for kind, r in direct.items()},
        "multipart_md5_vs_crc64nvme": _md5_vs_crc(rows),
        "multipart_md5_vs_crc64nvme_direct": _md5_vs_crc(direct),
        "what": f"{obj / MiB:g} MiB, multipart ones in {part / MiB:g} MiB parts",
    }


def _md5_vs_crc(rows: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float | None]:
    """shardcache's wall time and CPU per GB for the multipart MD5 object against the
    full-object CRC64NVME one."""
    crc, multipart = rows["full-object CRC64NVME"][SHARDCACHE], rows["multipart MD5"][SHARDCACHE]
    return {
        "wall": _ratio(multipart["wall_s"], crc["wall_s"]),
        "cpu": _ratio(multipart["cpu_s_per_gb"], crc["cpu_s_per_gb"]),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def _kind_ratios(row: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """shardcache's throughput and CPU per GB against boto3's, without and with its MD5."""
    s, plain, md5 = row[SHARDCACHE], row[BOTO3], row[BOTO3_MD5]
    return {
        "mb_s_vs_boto3": _ratio(s["mb_s"], plain["mb_s"]),
        "mb_s_vs_boto3_md5": _ratio(s["mb_s"], md5["mb_s"]),
        "cpu_vs_boto3": _ratio(s["cpu_s_per_gb"], plain["cpu_s_per_gb"]),
        "cpu_vs_boto3_md5": _ratio(s["cpu_s_per_gb"], md5["cpu_s_per_gb"]),
    }


def b6_large(b: Bench) -> dict[str, Any]:
    from shardcache.testing import RcloneS3Server

    cfg: Config = b.cfg["b6"]
    obj, part, _thr = cfg
    link: Link = b.cfg["link"]
    data = os.urandom(obj)
    put(b.s3, {KEY: data, WARM: os.urandom(1024)})
    moto_ceiling = _ranged_ceiling(b, b.s3, b.server_pid, KEY, cfg)
    moto = _over_the_link(b, b.s3, b.server_pid, KEY, cfg)
    with RcloneS3Server() as fast:
        fast.put_objects(BUCKET, {KEY: data}, checksum=peers.S3_CHECKSUM)
        fast.put_objects(BUCKET, {MD5_KEY: data, WARM: os.urandom(1024)})
        del data
        ceiling = _ranged_ceiling(b, fast, fast.pid, KEY, cfg)
        crc = _over_the_link(b, fast, fast.pid, KEY, cfg)
        md5 = _over_the_link(b, fast, fast.pid, MD5_KEY, cfg)
    kinds = _kinds(b)
    limit, frac = _fractions(crc, link, ceiling)
    _, md5_frac = _fractions(md5, link, ceiling)
    moto_limit, moto_frac = _fractions(moto, link, moto_ceiling)
    kind_fractions = {}
    for kind, rows in kinds["rows"].items():
        kind_limit, kind_fractions[f"SeaweedFS, {kind}"] = _fractions(rows, link, kinds["ceiling"])
    s = crc.pop(SHARDCACHE)
    peer_rows = {f"{n} (fast server)": r for n, r in crc.items()}
    peer_rows |= {f"{n} (fast server, MD5 ETag only)": r for n, r in md5.items()}
    peer_rows |= {f"{n} (moto)": r for n, r in moto.items()}
    for kind, rows in kinds["rows"].items():
        peer_rows |= {f"{n} (SeaweedFS, {kind})": r for n, r in rows.items()}
    for kind, rows in kinds["direct"].items():
        peer_rows |= {f"{n} (SeaweedFS unshaped, {kind})": r for n, r in rows.items()}
    return {
        "what": f"one {obj / MiB:g} MiB object, {part / MiB:g} MiB parts x {PARTS} in flight, "
        f"link: {link.describe()}; from the fast server (rclone serve s3) uploaded with a "
        f"{peers.S3_CHECKSUM} checksum (the verdict), the same bytes with an MD5 ETag only, "
        "and from moto, which copies the whole object for every ranged GET and answers them "
        "one after another (no client fills the link from it); from SeaweedFS four kinds "
        f"of object ({kinds['what']}: {', '.join(KINDS)}; limit {kind_limit:.1f} MB/s), "
        "shardcache verifying each, boto3 without and with an MD5 pass over its file, through "
        "the link and again unshaped (straight from the server); each "
        "server's ranged ceiling measured in this run (plain boto3 ranged GETs of the same "
        "parts, unshaped)",
        "shardcache": s,
        "peers": peer_rows,
        "server_ranged_ceiling": ceiling,
        "moto_ranged_ceiling": moto_ceiling,
        "seaweedfs_ranged_ceiling": kinds["ceiling"],
        "limit_mb_s": round(limit, 2),
        "limit_is": "link" if limit < ceiling["mb_s"] else "server",
        "ratio": round(s["mb_s"] / crc[S3FS]["mb_s"], 2),
        "link_fraction": frac[SHARDCACHE],
        "link_fractions": {
            "fast server": frac,
            "fast server, MD5 ETag only": md5_frac,
            f"moto (limit {moto_limit:.1f} MB/s)": moto_frac,
        }
        | kind_fractions,
        "kind_ratios": kinds["ratios"],
        "kind_ratios_unshaped": kinds["direct_ratios"],
        "multipart_md5_vs_crc64nvme": kinds["multipart_md5_vs_crc64nvme"],
        "multipart_md5_vs_crc64nvme_unshaped": kinds["multipart_md5_vs_crc64nvme_direct"],
        "target": ">= 90% of min(link capacity, server ranged ceiling), from the fast server",
        "verdict": verdict(frac[SHARDCACHE] >= 0.9),
    }
