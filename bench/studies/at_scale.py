"""At scale, on paper and by simulation: requests to S3 per epoch and at job start.

    python -m bench.studies.at_scale [--nodes 1000 --ranks 8 --workers 4 --shards 20000 ...]

Nothing is downloaded. The planning is shardcache's own code, run for every rank and
worker of the job: ``shardcache.split_by_node`` then ``webdataset.split_by_worker`` (a
WebDataset pipeline: the same shares every epoch) and ``ResumableDataset``'s sample-level
split (``_datasets.epoch_split``: each rank's shards the same every epoch, in another order), the
scope directories
(``Settings.scope_dir``), ``warm.plan_warm --split auto``, the prefetch and ranged-GET
defaults (``_config.SPECS``) and the choice of a ranged download
(``ParallelDownload.suits``). The SlowDown part replays the job start with a stand-in for
one S3 prefix (a token bucket of ``--limit`` requests/s that answers the excess at once) and
shardcache's own ``RetryPolicy.delay`` and ``Throttle``, on a clock of its own.

The model, stated (every figure is a parameter):
* every shard is read once per epoch by one DataLoader worker; a cache keeps everything it
  fetched (no eviction); the cache root is node-local except for "shared FS";
* a request's duration is ``--latency`` plus its bytes at the per-connection rate, the
  node's link shared equally by its connections; a shard's first request is a GET of the
  whole object (its headers give size and checksum; it carries the first part when the
  object is fetched in ranged parts), so there is no HEAD;
* S3's prefix takes ``--limit`` GET/HEAD requests/s (5,500 per partitioned prefix,
  documented) and answers the rest with 503 SlowDown at once: all shards share one prefix,
  not yet partitioned further (S3 partitions a busy prefix only over minutes);
* the SlowDown replay is 1/``--scale`` of the job (processes and limit both divided), which
  keeps every per-process figure; counts are multiplied back.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import math
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import webdataset as wds

from bench.support.infra import env_vars
from shardcache import Settings, split_by_node
from shardcache._config.settings import SPECS
from shardcache._datasets.epoch_split import EpochSplit
from shardcache._retry.policy import RetryPolicy
from shardcache._retry.throttle import Throttle
from shardcache._transfer.download import ObjectInfo
from shardcache._transfer.remote import Remote
from shardcache.warm import plan_warm

S3_GET_LIMIT = 5500  # GET/HEAD requests per second per partitioned prefix (S3's documentation)
THREADS = SPECS["threads"].default
DEPTH = SPECS["prefetch_depth"].default
PARTS = SPECS["parallel_parts"].default
PART_SIZE = SPECS["part_size"].default


@dataclass(frozen=True)
class Job:
    nodes: int
    ranks: int  # per node
    workers: int  # DataLoader workers per rank
    shards: int
    shard_size: int  # bytes
    conn_rate: float  # bytes/s of one connection
    node_rate: float  # bytes/s of a node's link
    latency: float  # seconds to the first byte

    @property
    def world(self) -> int:
        return self.nodes * self.ranks


def wds_reads(job: Job, epoch: int) -> Iterator[tuple[int, int, list[int]]]:
    """(node, rank, shards) per DataLoader worker: ``split_by_node`` then
    ``wds.split_by_worker``, as every rank's pipeline runs them (same every epoch)."""
    shards = list(range(job.shards))
    for rank in range(job.world):
        with env_vars(SHARDCACHE_RANK=str(rank), SHARDCACHE_WORLD_SIZE=str(job.world)):
            share = list(split_by_node(shards))
        for worker in range(job.workers):
            with env_vars(WORKER=str(worker), NUM_WORKERS=str(job.workers)):
                yield rank // job.ranks, rank, list(wds.split_by_worker(share))


SAMPLES_PER_SHARD = 8  # the split's cost grows with samples; which shards are read does not


def resumable_reads(job: Job, epoch: int, scope: str) -> Iterator[tuple[int, int, list[int]]]:
    """The same for ``ResumableDataset``: its sample-level split, over the caches of
    ``scope`` (a rank's or a node's shards stay its own, read in another order each epoch)."""
    split = _split(job.shards)
    consumers = job.world * job.workers
    per_unit = job.workers * (1 if scope == "rank" else job.ranks)
    for rank in range(job.world):
        for worker in range(job.workers):
            share = split.fresh(epoch, consumers, per_unit, rank * job.workers + worker)
            yield rank // job.ranks, rank, [p.shard for p in share.pieces]


@functools.cache
def _split(shards: int) -> EpochSplit:
    """One split per shard count: it keeps each cache count's hand-out once computed."""
    starts = [list(range(0, 512 * SAMPLES_PER_SHARD, 512))] * shards
    return EpochSplit(starts, seed=0, shuffle=True, remainder="pad")


def cache_key(scope: str, node: int, rank: int, root: Path) -> tuple[Any, ...]:
    """Which cache directory a rank reads through: its scope directory, on its node's disk
    (rank, node) or on one file system every node mounts (shared)."""
    settings = Settings.resolve(
        env={}, cache_dir=root, scope="rank" if scope == "rank" else "node", rank=rank
    )
    return (settings.scope_dir,) if scope == "shared" else (node, settings.scope_dir)


def requests_per_shard(size: int) -> int:
    """GETs one download costs with the default settings: one per part when
    ``ParallelDownload.suits`` the object (the first part from the whole-object GET whose
    headers gave the size, the others ranged), else one GET. No HEAD."""
    s = Settings.resolve(env={})
    from shardcache._cache.shard_cache import ShardCache

    remote: Remote = ShardCache(settings=s).remote  # the options exactly as a cache has them
    with tempfile.TemporaryFile() as out:
        ranged = remote.parallel.suits(ObjectInfo("s3://b/k.tar", size), out)
    return math.ceil(size / s.part_size) if ranged else 1


Reads = list[tuple[int, int, list[int]]]  # (node, rank, shards) per DataLoader worker


def plan_reads(job: Job, pattern: str, scope: str, epochs: int = 2) -> list[Reads]:
    """Every worker's shards in each epoch of ``pattern`` ("wds" or "resumable") with the
    caches of ``scope``."""
    if pattern == "wds":
        return [list(wds_reads(job, epoch)) for epoch in range(epochs)]
    return [list(resumable_reads(job, epoch, scope)) for epoch in range(epochs)]


def per_epoch(job: Job, plan: list[Reads], scope: str) -> list[dict[str, float]]:
    """Downloads, GETs and bytes per node in each epoch of ``plan``."""
    gets = requests_per_shard(job.shard_size)
    root = Path("/local/shardcache")
    keys = {
        (n, r): cache_key(scope, n, r, root)
        for n in range(job.nodes)
        for r in range(n * job.ranks, (n + 1) * job.ranks)
    }
    cached: dict[tuple[Any, ...], set[int]] = {}
    out = []
    for reads in plan:
        downloads = 0
        read_bytes_per_node = [0] * job.nodes
        for node, rank, shards in reads:
            have = cached.setdefault(keys[node, rank], set())
            new = [s for s in shards if s not in have]
            have.update(new)
            downloads += len(new)
            read_bytes_per_node[node] += len(shards) * job.shard_size
        out.append(
            {
                "downloads": downloads,
                "gets": downloads * gets,
                "s3_bytes_per_node": downloads * job.shard_size / job.nodes,
                # on a shared FS every read crosses the network, hit or miss
                "net_bytes_per_node": max(read_bytes_per_node) if scope == "shared" else 0,
            }
        )
    return out


def job_start(job: Job, processes: int, threads: int) -> dict[str, float]:
    """The first wave: ``processes`` prefetchers per job, each starting ``threads`` shards
    (its first GET, sent at once, then ``PARTS`` GETs in flight when the object is large)."""
    gets = requests_per_shard(job.shard_size)
    parts = min(PARTS, gets) if gets > 1 else 1
    per_request = job.shard_size / gets
    conns_per_node = processes / job.nodes * threads * parts
    rate = min(job.conn_rate, job.node_rate / conns_per_node)
    duration = job.latency + per_request / rate
    in_flight = processes * threads * parts
    return {
        "processes": processes,
        "first_burst": processes * threads,  # each shard's first GET, all within one latency
        "first_burst_rate": processes * threads / job.latency,
        "in_flight": in_flight,
        "request_s": duration,
        "get_rate": in_flight / duration,
        "node_mb_s": conns_per_node * rate / 1e6,
        "slots": threads * parts,
    }


# ----------------------------------------------------------------- SlowDown replay


def replay(  # noqa: PLR0915 (one event loop, read top to bottom)
    job: Job,
    start: dict[str, float],
    *,
    mode: str,
    slowdown_time: float,
    seconds: float,
    scale: int,
    seed: int,
) -> dict[str, float]:
    """The job start against a prefix of ``S3_GET_LIMIT / scale`` requests/s.

    ``mode``: "per-request" (each request backs off on its own: ``RetryPolicy.delay``),
    "throttle" (the same, plus the process's shared ``Throttle``), or "cap" (the throttle
    with ``max_request_rate`` = the limit shared by the processes). ``slowdown_time``: the
    policy's ``SHARDCACHE_SLOWDOWN_RETRY_TIME`` (0: every refusal counts as an attempt)."""
    random.seed(seed)
    procs = max(1, round(start["processes"] / scale))
    slots = int(start["slots"])
    limit = S3_GET_LIMIT * procs / start["processes"]
    now = [0.0]
    policy = RetryPolicy(slowdown_time=slowdown_time)
    cap = limit / procs if mode == "cap" else None
    throttles = [
        Throttle(cap, clock=lambda: now[0], sleep=lambda s: None) if mode != "per-request" else None
        for _ in range(procs)
    ]
    tokens, stamp = limit, 0.0
    sent = refused = failed = 0
    admitted_late = sent_late = refused_late = 0  # after the first 10 s (the steady state)
    events: list[tuple[float, int, int, str, float]] = []
    attempt = [0] * (procs * slots)  # failures that count against the retries
    tries = [0] * (procs * slots)  # every refused attempt (the backoff grows with them)
    first_refusal: list[float | None] = [None] * (procs * slots)
    longest_refused = 0.0  # the longest a request was refused in a row (s)
    seq = 0

    def push(t: float, slot: int, kind: str, at: float = 0.0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, slot, kind, at))

    for slot in range(procs * slots):
        push(0.0, slot, "ready")
    while events:
        t, _, slot, kind, at = heapq.heappop(events)
        if t > seconds:
            break
        now[0] = t
        throttle = throttles[slot // slots]
        if kind == "answered":
            if throttle:
                throttle.succeeded()
            kind = "ready"
        if kind == "ready":
            due, wait = throttle.poll() if throttle else (True, t)
            push(t if due else t + wait, slot, "send" if due else "ready")
        elif kind == "send":
            sent += 1
            tokens = min(limit, tokens + (t - stamp) * limit)
            stamp = t
            if tokens >= 1:
                tokens -= 1
                admitted_late += t >= 10
                sent_late += t >= 10
                attempt[slot], tries[slot], first_refusal[slot] = 0, 0, None
                push(t + start["request_s"], slot, "answered")
            else:
                refused += 1
                sent_late += t >= 10
                refused_late += t >= 10
                push(t + job.latency, slot, "refused", t)
        else:  # refused: the answer arrives
            if throttle:
                throttle.throttled(at)
            first = first_refusal[slot]
            if first is None:
                first = first_refusal[slot] = t
            longest_refused = max(longest_refused, t - first)
            attempt[slot] += policy.counts(True, t - first)
            tries[slot] += 1
            if not policy.allows(attempt[slot]):
                failed += 1  # TransientFetchError: the shard fails, the thread moves on
                attempt[slot], tries[slot], first_refusal[slot] = 0, 0, None
                push(t, slot, "ready")
            else:
                push(t + policy.delay(tries[slot]), slot, "ready")
    return {
        "sent": sent * scale,
        "refused": refused * scale,
        "refused_pct": 100 * refused / max(sent, 1),
        "failed": failed * scale,
        "refused_pct_after_10s": 100 * refused_late / max(sent_late, 1),
        "admitted_per_s_after_10s": admitted_late * scale / max(seconds - 10, 1e-9),
        "longest_refused_s": longest_refused,
    }


# ----------------------------------------------------------------- report


def _n(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def _gib(x: float) -> str:
    return f"{x / 2**30:g} GiB"


def report(job: Job, seconds: float, scale: int, seed: int) -> str:
    gets = requests_per_shard(job.shard_size)
    lines = [
        f"Job: {job.nodes} nodes x {job.ranks} ranks x {job.workers} DataLoader workers; "
        f"{job.shards:,} shards of {_gib(job.shard_size)}; defaults: threads {THREADS}, depth "
        f"{DEPTH}, parts of {PART_SIZE >> 20} MiB, {PARTS} in flight; one shard = {gets} GET(s), "
        f"no HEAD; links: {job.conn_rate / 1e6:g} MB/s per connection, "
        f"{job.node_rate * 8 / 1e9:g} Gb/s per node, {job.latency * 1e3:g} ms to first byte.",
        "",
        "Per epoch (requests at the limit: the time the prefix needs to answer them at "
        f"{S3_GET_LIMIT:,}/s):",
        "",
        "| reads | scope | epoch | downloads | GETs | at the limit | from S3 per node"
        " | network FS reads, busiest node |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    patterns = (
        ("wds", "WebDataset split (fixed)"),
        ("resumable", "ResumableDataset (stable split)"),
    )
    for pattern, label in patterns:
        plans: dict[str, list[Reads]] = {}
        for scope in ("rank", "node", "shared"):
            caches = "rank" if scope == "rank" else "node"  # shared: a node's directory
            if pattern == "wds":  # the same shares whatever the scope
                caches = "any"
            if caches not in plans:
                plans[caches] = plan_reads(job, pattern, scope)
            for epoch, row in enumerate(per_epoch(job, plans[caches], scope), 1):
                minutes = row["gets"] / S3_GET_LIMIT / 60
                shared = _gb(row["net_bytes_per_node"]) if scope == "shared" else "-"
                lines.append(
                    f"| {label} | {scope} | {epoch} | {_n(row['downloads'])} | "
                    f"{_n(row['gets'])} | {minutes:,.1f} min | "
                    f"{_gb(row['s3_bytes_per_node'])} | {shared} |"
                )
    warm_rank = plan_warm(
        list(range(job.shards)),
        split="auto",
        scope="node",
        rank=0,
        world_size=job.world,
        local_rank=0,
        local_world_size=job.ranks,
    )
    warmers = job.nodes  # local rank 0 of each node (plan_warm: the others are inactive)
    starts = {
        "training start, every DataLoader worker prefetching (any scope)": job_start(
            job, job.world * job.workers, THREADS
        ),
        f"warm --split auto, node scope ({len(warm_rank.urls)} shards per node)": job_start(
            job, warmers, THREADS
        ),
    }
    lines += [
        "",
        f"Job start (peak; S3 takes {S3_GET_LIMIT:,} GET/HEAD per second per prefix):",
        "",
        "| start | processes | first GETs (burst) | their rate (x limit) | GETs in flight"
        " | one GET | GET rate (x limit) | per node |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, s in starts.items():
        firsts, gets = s["first_burst_rate"], s["get_rate"]
        lines.append(
            f"| {label} | {_n(s['processes'])} | {_n(s['first_burst'])} | {_n(firsts)}/s "
            f"({firsts / S3_GET_LIMIT:,.0f}x) | {_n(s['in_flight'])} | {s['request_s']:.2f} s | "
            f"{_n(gets)}/s ({gets / S3_GET_LIMIT:,.1f}x) | {s['node_mb_s']:,.0f} MB/s |"
        )
    start = starts["training start, every DataLoader worker prefetching (any scope)"]
    lines += [
        "",
        f"SlowDown at training start, first {seconds:g} s (replayed at 1/{scale} scale; "
        f"retries {SPECS['retries'].default}, backoff {SPECS['retry_backoff'].default:g} s "
        "doubling):",
        "",
        "| client | requests sent | refused (503) | refused % | after 10 s: refused % |"
        " admitted/s | longest refused in a row | downloads failed (retries exhausted) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fair = S3_GET_LIMIT / start["processes"]
    patience = SPECS["slowdown_retry_time"].default
    for mode, slowdown_time, label in (
        ("per-request", 0.0, "backoff per request, every refusal an attempt (before the throttle)"),
        ("throttle", 0.0, "shared throttle per process, every refusal an attempt (RETRY_TIME=0)"),
        ("throttle", patience, f"shared throttle, refusals retried for {patience:g} s (defaults)"),
        ("cap", patience, f"shared throttle + SHARDCACHE_MAX_REQUEST_RATE={fair:.3g}"),
    ):
        r = replay(
            job,
            start,
            mode=mode,
            slowdown_time=slowdown_time,
            seconds=seconds,
            scale=scale,
            seed=seed,
        )
        lines.append(
            f"| {label} | {_n(r['sent'])} | {_n(r['refused'])} | {r['refused_pct']:.1f} % | "
            f"{r['refused_pct_after_10s']:.1f} % | {_n(r['admitted_per_s_after_10s'])} | "
            f"{r['longest_refused_s']:.1f} s | {_n(r['failed'])} |"
        )
    return "\n".join(lines)


def _size(text: str) -> int:
    from shardcache._config.settings import parse_size

    return parse_size(text, "--shard-size")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.studies.at_scale", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=8, help="ranks per node")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank")
    p.add_argument("--shards", type=int, default=100_000)
    p.add_argument("--shard-size", type=_size, default=1 << 30, help="default 1GiB")
    p.add_argument("--conn-mb-s", type=float, default=90.0, help="MB/s of one connection")
    p.add_argument("--node-gbit-s", type=float, default=100.0, help="Gb/s of a node's link")
    p.add_argument("--latency", type=float, default=0.03, help="seconds to the first byte")
    p.add_argument("--seconds", type=float, default=60.0, help="replayed job start")
    p.add_argument("--scale", type=int, default=100, help="replay at 1/scale of the job")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    job = Job(
        a.nodes,
        a.ranks,
        a.workers,
        a.shards,
        a.shard_size,
        a.conn_mb_s * 1e6,
        a.node_gbit_s * 1e9 / 8,
        a.latency,
    )
    print(report(job, a.seconds, a.scale, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
