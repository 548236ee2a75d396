"""B2: a cold epoch over the shaped link; shardcache and every peer at the same concurrency T."""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from bench.support import peers
from bench.support.common import Bench, clear_fs_caches, new_cache, read_shardcache, verdict
from bench.support.infra import (
    BUCKET,
    MB,
    CpuMeter,
    Link,
    MiB,
    count_samples,
    install_wds_s3_opener,
    make_shard,
    median,
    presigned,
    put,
    samples_per_shard,
)

NOT_INSTALLED = "not installed"


class RowError(Exception):
    """A reader misbehaved (wrong sample count): its row is reported as an error."""


def link_capacity(link: Link, connections: int) -> float:
    """Bytes/s the shaped link carries with ``connections`` busy connections."""
    rates = [r for r in (link.total_rate, link.conn_rate and link.conn_rate * connections) if r]
    return min(rates) if rates else float("inf")


def _converted(b: Bench, shards: dict[str, bytes]) -> dict[str, Any]:
    """litdata's and Mosaic's copies of the same samples, written by their own writers and
    uploaded to the same bucket; a peer whose package is missing maps to its reason."""
    size = max(len(v) for v in shards.values())
    out: dict[str, Any] = {}
    for name, prefix, write in (
        ("litdata", "ld", lambda d: peers.write_litdata(list(shards.values()), d, size)),
        ("mosaic", "mds", lambda d: peers.write_mds(list(shards.values()), d, size)),
    ):
        try:
            files = write(b.fresh_dir(f"b2{prefix}"))
        except peers.PeerMissing as exc:
            out[name] = exc  # reported in the peer's row
            continue
        put(b.s3, {f"b2{prefix}/{p.name}": p.read_bytes() for p in files})
        out[name] = f"s3://{BUCKET}/b2{prefix}"
    return out


@contextlib.contextmanager
def _loader_for(
    name: str, remote: str, so: dict[str, Any], b: Bench, threads: int
) -> Iterator[Any]:
    if name == "litdata":
        yield peers.litdata_loader(remote, so, str(b.fresh_dir("b2ldc")), threads)
    else:
        with peers.mds_loader(remote, so["endpoint_url"], str(b.fresh_dir("b2mdc")), threads) as ld:
            yield ld


def _measure(
    fn: Callable[[], tuple[int, int]], pids: dict[str, int], expected: int
) -> dict[str, Any]:
    import time

    with CpuMeter(pids) as meter:
        t0 = time.monotonic()
        n, _ = fn()
        wall = time.monotonic() - t0
    if n != expected:
        raise RowError(f"yielded {n} samples, expected {expected}")
    return {"wall": wall, **meter.result}


def _summary(runs: list[dict[str, Any]], samples: int, nbytes: int) -> dict[str, Any]:
    wall = median([r["wall"] for r in runs])
    res: dict[str, Any] = {
        "samples_s": round(samples / wall, 1),
        "mb_s": round(nbytes / MB / wall, 2),
        "wall_s": round(wall, 3),
        "reps": len(runs),
    }
    for key in runs[0]:
        if key.endswith("_cpu_pct"):
            res[key] = round(median([r[key] for r in runs]), 1)
    return res


def _results(  # noqa: PLR0917
    names: list[str],
    runs: dict[str, list[dict[str, Any]]],
    skipped: dict[str, str],
    errors: dict[str, str],
    expected: int,
    nbytes: int,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in names:
        if name in skipped:
            results[name] = {"status": skipped[name]}
        elif name in errors:
            results[name] = {"error": errors[name]}
        else:
            results[name] = _summary([r for r in runs[name] if r["epoch"] == 1], expected, nbytes)
            warm = [r for r in runs[name] if r["epoch"] == 2]
            if warm:
                results[name.replace("epoch 1 (cold)", "epoch 2 (warm)")] = _summary(
                    warm, expected, nbytes
                )
    return results


def b2_cold(b: Bench) -> dict[str, Any]:
    count, size = b.cfg["b2"]
    threads: int = b.cfg["threads"]
    sample = b.cfg["sample"]
    shards = {f"b2-{i:06d}.tar": make_shard(size, sample, i) for i in range(count)}
    put(b.s3, shards)
    urls = [f"s3://{BUCKET}/{k}" for k in shards]
    nbytes = sum(len(v) for v in shards.values())
    expected = count * samples_per_shard(size, sample)
    converted = _converted(b, shards)
    peers.preload()  # imports outside the clock, so the first row pays none
    link: Link = b.cfg["link"]
    t = threads
    sc_name = f"shardcache threads={t}"
    runs: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    with b.link() as (so, pids):
        install_wds_s3_opener(so)
        endpoint = so["endpoint_url"]
        region = so["client_kwargs"]["region_name"]
        streamed = presigned(b.s3.boto3_client(endpoint), urls)
        rows: dict[str, Any] = {  # name -> a reader, or (peer, its converted copy)
            sc_name: lambda: read_shardcache(urls, new_cache(b.fresh_dir("b2"), so), threads=t),
            "shardcache threads=1": lambda: read_shardcache(
                urls, new_cache(b.fresh_dir("b2"), so), threads=1
            ),
            f"webdataset streaming, DataLoader(num_workers={t})": lambda: peers.read_wds_loader(
                streamed, t
            ),
            f"webdataset cache_dir=, DataLoader(num_workers={t})": lambda: peers.read_wds_loader(
                urls, t, cache_dir=str(b.fresh_dir("b2w"))
            ),
            f"s3fs get, {t} threads": lambda: peers.read_pool(
                urls, peers.s3fs_fetcher(so, b.fresh_dir("b2s")), t
            ),
            f"boto3 download_file, {t} threads": lambda: peers.read_pool(
                urls, peers.boto3_fetcher(b.s3.boto3_client(endpoint), b.fresh_dir("b2b")), t
            ),
            f"s3torchconnector, DataLoader(num_workers={t})": lambda: peers.read_s3torchconnector(
                urls, endpoint, region, t
            ),
        }
        for name, remote in converted.items():
            rows[f"{name} epoch 1 (cold), DataLoader(num_workers={t})"] = (name, remote)
        skipped: dict[str, str] = {}
        for rep in range(b.cfg["reps"]):
            order = list(rows) if rep % 2 == 0 else list(reversed(rows))  # alternate
            for name in order:
                if name in errors or name in skipped:
                    continue
                clear_fs_caches()
                b.s3.clear_requests()
                try:
                    runs.setdefault(name, []).extend(
                        _run_row(b, name, rows[name], so, pids, expected, t)
                    )
                except peers.PeerMissing as exc:
                    skipped[name] = f"{NOT_INSTALLED} ({exc})"
                except Exception as exc:  # a peer failing must show, loudly, in its row
                    errors[name] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                    print(f"B2 row {name!r} FAILED: {errors[name]}", file=sys.stderr, flush=True)
    results = _results(list(rows), runs, skipped, errors, expected, nbytes)
    s = results.pop(sc_name)
    capacity = link_capacity(link, t)
    link_frac = s["mb_s"] / (capacity / MB)
    cold_peers = {
        n: r["samples_s"]
        for n, r in results.items()
        if "samples_s" in r and "threads=1" not in n and "(warm)" not in n
    }
    best = max(cold_peers, key=cold_peers.__getitem__) if cold_peers else None
    ratio = s["samples_s"] / cold_peers[best] if best else None
    return {
        "what": f"{count} x {size / MiB:g} MiB shards ({expected} samples), cold, link: "
        f"{link.describe()}; T={t} for shardcache and every peer (litdata/Mosaic: the same "
        "samples in their own formats, same bucket, same link); mb_s = the tar shards' bytes "
        "/ wall; WebDataset streaming reads presigned http URLs with its own curl opener, "
        "cache_dir= and the rest the s3:// URLs"
        + "".join(f"; {note}" for note in sorted(peers.NOTES)),
        "shardcache": s,
        "peers": results,
        "ratio": round(ratio, 2) if ratio else None,
        "best_peer": best,
        "link_fraction": round(link_frac, 3),
        "row_errors": errors,
        "target": f">= 90% of the link's aggregate capacity ({capacity / MB:g} MB/s with {t} "
        "connections) and >= 1.0x the best equal-concurrency peer (samples/s)",
        "verdict": verdict(link_frac >= 0.9 and (ratio is None or ratio >= 1.0) and not errors),
    }


def _run_row(  # noqa: PLR0917
    b: Bench,
    name: str,
    row: Any,
    so: dict[str, Any],
    pids: dict[str, int],
    expected: int,
    threads: int,
) -> list[dict[str, Any]]:
    if not isinstance(row, tuple):
        return [_measure(row, pids, expected) | {"epoch": 1}]
    peer, remote = row
    if isinstance(remote, peers.PeerMissing):
        raise remote
    out = []
    with _loader_for(peer, remote, so, b, threads) as loader:
        for epoch in (1, 2):  # epoch 1 cold, epoch 2 warm from the peer's own cache
            res = _measure(lambda: count_samples(iter(loader)), pids, expected)
            out.append(res | {"epoch": epoch})
    return out
