"""B13: requests and bytes per epoch over 3 epochs, at rank and node scope, against WebDataset
``cache_dir=`` and Mosaic Streaming on the same samples.

The question: after the first epoch, does each reader's cache hold what its ranks read in the
next epochs, so that training makes no request? And what does the first epoch cost?

Job. 2 ranks x 2 DataLoader workers, each rank a real process (spawned, with torchrun's
variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` /
``MASTER_PORT``, and a gloo process group), one node. Each rank iterates a torch DataLoader
(``batch_size=batch``, ``num_workers=2``, forked workers) over each reader in turn, 3 epochs
each; a collate turns every sample into a digest of its ``bin`` payload (the sample's
identity, the same for every reader; nothing is decoded). The same readers, the same
concurrency (2 ranks x 2 workers; each reader's own threads at their defaults) and the same
link (unshaped: requests and bytes are counted, not timed) for everyone.

Scopes. *rank*: one cache directory per rank. *node*: one cache directory shared by both
ranks (shardcache: ``SHARDCACHE_SCOPE=node``; WebDataset: both ranks given the same
``cache_dir=``; Mosaic: its ``local`` directory, per node by design).

Readers, each set up as its own documentation recommends:

- *shardcache*: ``ResumableDataset(urls, seed=0, index=FILE, cache=ShardCache(dir))``,
  ``set_epoch(e)`` before each epoch. The sample index is made ahead (``learn`` through a
  throwaway cache, direct to the server, before anything is counted: one GET per shard, once,
  like Mosaic's conversion). One more row, *index learned* (rank scope, no ``index=``): the
  ranks learn the offsets together, each through its own cache and its own shards, gathered
  through the process group.
- *WebDataset 1.0.2*: ``wds.WebDataset(urls, cache_dir=dir, shardshuffle=len(urls),
  detshuffle=True, seed=0, nodesplitter=wds.split_by_node, workersplitter=
  wds.split_by_worker)`` under ``DataLoader(persistent_workers=True)``: its FAQ's answer to
  "detshuffle's epoch does not increment" (the epoch counter lives in the workers). s3://
  URLs are opened by an fsspec (s3fs) opener, as in B2. One more row at rank scope: the plain
  ``shardshuffle=len(urls), seed=0`` (no detshuffle), which shuffles with a fresh
  ``random.Random(seed)`` every iteration. In 1.0.2 the shard shuffle runs after the node
  and worker split, so each rank reads the same shards in every epoch.
- *Mosaic Streaming 0.13*: the same samples converted with its own ``MDSWriter``
  (``peers.write_mds``, as B2, shards of about one tar shard) and uploaded beside the tars;
  ``StreamingDataset(remote=, local=, shuffle=True, shuffle_seed=0, batch_size=batch)``
  (default ``py1e`` shuffle, canonical nodes = physical nodes), its epoch counter advancing
  by itself at each iteration; ``S3_ENDPOINT_URL`` points its boto3 client at the server.
  Node scope: one ``local`` for both ranks. Rank scope is not applicable: Mosaic refuses a
  ``local`` per rank on one node (ranks of a node must share it:
  ``streaming/base/shared/prefix.py`` raises "shared memory prefix ... was not registered by
  local leader. This may be because you specified different ``local`` parameters from
  different ranks"), and telling each rank it is a node of its own (``LOCAL_WORLD_SIZE=1``)
  does not work on one machine either: both ranks, each its node's leader, register the
  same shared-memory prefix (tried: ``FileExistsError: '/000001_locals'``).

Counting. The ranks reach the server (moto, own process) through a FaultProxy (own process,
unshaped) that records every request's method, path and the response body bytes it relayed;
GETs are counted from the server's own request log and must equal the proxy's count (else
the row is an error). After each epoch every rank and the coordinator meet at a barrier: the
epoch's GETs (of the data's keys: tars, MDS shards and Mosaic's ``index.json``), bytes of
their bodies, other requests (HEAD, LIST) are taken then. Per epoch: samples delivered
(every sample of the epoch must come, else the row is an error), whether the order differs
from the previous epoch's (both ranks' sequences), and how many of a rank's samples it also
had in the previous epoch (``same_rank_pct``).

Target (shardcache only; the peers are reported): epochs 1 and 2 make no GET at rank and
node scope with the index made ahead, and epoch 0 fetches each shard once per cache that
reads it (a shard split between two caches is read by both).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.support import peers
from bench.support.common import Bench, verdict
from bench.support.counting_proxy import counting_proxy
from bench.support.infra import (
    BUCKET,
    CTX,
    MB,
    env_vars,
    install_wds_s3_opener,
    make_shard,
    put,
    samples_per_shard,
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"shards": 8, "shard_bytes": 200_000, "sample": 20_000, "batch": 8, "timeout": 120},
    "full": {"shards": 32, "shard_bytes": 2 << 20, "sample": 20_000, "batch": 16, "timeout": 600},
}
RANKS, WORKERS, EPOCHS, SEED = 2, 2, 3, 0
PREFIX = "b13"  # every key of the data (tars, MDS shards, Mosaic's index) starts with it
MDS_PREFIX = f"{PREFIX}mds"
NOT_INSTALLED = "not installed"
MOSAIC_RANK_SCOPE = (
    "not applicable: Mosaic Streaming's `local` is per node, shared by the node's ranks; a "
    "`local` per rank is refused (streaming/base/shared/prefix.py: 'shared memory prefix ... "
    "was not registered by local leader. This may be because you specified different `local` "
    "parameters from different ranks'), and each rank posing as a node of its own "
    "(LOCAL_WORLD_SIZE=1) collides on the machine's shared memory (both leaders register "
    "the same prefix: FileExistsError '/000001_locals')"
)

# (name, kind, scope, options): the rows, in the order they run.
READERS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("shardcache", "shardcache", "rank", {"index": True}),
    ("shardcache", "shardcache", "node", {"index": True}),
    ("shardcache, index learned", "shardcache", "rank", {"index": False}),
    ("webdataset cache_dir=", "wds", "rank", {"detshuffle": True}),
    ("webdataset cache_dir=", "wds", "node", {"detshuffle": True}),
    ("webdataset cache_dir=, seed without detshuffle", "wds", "rank", {"detshuffle": False}),
    ("mosaic streaming", "mosaic", "node", {}),
]


def row_name(name: str, scope: str) -> str:
    return f"{name} ({scope} scope)"


# ---------------------------------------------------------------------------- the ranks
def _ids(batch: list[dict[str, Any]]) -> list[str]:
    """Each sample's identity: a digest of its payload (the same bytes in every format)."""
    return [hashlib.blake2b(bytes(s["bin"]), digest_size=8).hexdigest() for s in batch]


def _cache_dir(work: Path, name: str, scope: str, options: dict[str, Any], rank: int) -> Path:
    tag = "".join(c if c.isalnum() else "-" for c in f"{name}-{scope}-{sorted(options.items())}")
    path = work / tag / (f"rank-{rank}" if scope == "rank" else "node")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _loader(dataset: Any, cfg: dict[str, Any], **kw: Any) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=cfg["batch"],
        num_workers=WORKERS,
        collate_fn=_ids,
        multiprocessing_context="fork",
        timeout=cfg["timeout"],
        **kw,
    )


class _Reader:
    """One reader in one rank: ``epoch(e)`` returns the sample identities in order."""

    def __init__(self, kind: str, scope: str, options: dict[str, Any], ctx: dict[str, Any]):
        self.kind, self.options = kind, options
        cfg, so, rank = ctx["cfg"], ctx["so"], ctx["rank"]
        root = _cache_dir(ctx["work"], kind, scope, options, rank)
        self.env = {"SHARDCACHE_SCOPE": scope}
        with env_vars(**self.env):
            if kind == "shardcache":
                import shardcache

                self.dataset = shardcache.ResumableDataset(
                    ctx["urls"],
                    seed=SEED,
                    index=ctx["index"] if options["index"] else None,
                    cache=shardcache.ShardCache(root, storage_options=so),
                )
                self.loader = _loader(self.dataset, cfg)
            elif kind == "wds":
                import webdataset as wds

                install_wds_s3_opener(so)
                self.dataset = wds.WebDataset(
                    ctx["urls"],
                    cache_dir=str(root),
                    shardshuffle=len(ctx["urls"]),
                    detshuffle=options["detshuffle"],
                    seed=SEED,
                    nodesplitter=wds.split_by_node,
                    workersplitter=wds.split_by_worker,
                )
                self.loader = _loader(self.dataset, cfg, persistent_workers=True)
            else:
                peers.require_mosaic()
                from streaming import StreamingDataset

                self.dataset = StreamingDataset(
                    remote=ctx["mds"],
                    local=str(root),
                    shuffle=True,
                    shuffle_seed=SEED,
                    batch_size=cfg["batch"],
                )
                self.loader = _loader(self.dataset, cfg)

    def epoch(self, epoch: int) -> list[str]:
        with env_vars(**self.env):
            if self.kind == "shardcache":
                self.dataset.set_epoch(epoch)
            return [sample for batch in self.loader for sample in batch]

    def close(self) -> None:
        iterator = getattr(self.loader, "_iterator", None)  # persistent workers
        if iterator is not None:
            iterator._shutdown_workers()
        del self.loader, self.dataset
        gc.collect()


def _rank_main(rank: int, ctx: dict[str, Any], barrier: Any, results: Any) -> None:
    """One rank: every reader, 3 epochs each, meeting the coordinator after each epoch."""
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(RANKS),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(RANKS),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(ctx["master_port"]),
        AWS_ENDPOINT_URL=ctx["so"]["endpoint_url"],
        S3_ENDPOINT_URL=ctx["so"]["endpoint_url"],  # Mosaic's boto3 client
    )
    ctx = ctx | {"rank": rank}
    dist.init_process_group("gloo")
    timeout = ctx["cfg"]["timeout"]
    try:
        for name, kind, scope, options in ctx["readers"]:
            reader, error = None, None
            try:
                reader = _Reader(kind, scope, options, ctx)
            except Exception as exc:
                error = _error(exc)
            for epoch in range(EPOCHS):
                t0 = time.monotonic()
                ids: list[str] = []
                if error is None and reader is not None:
                    try:
                        ids = reader.epoch(epoch)
                    except Exception as exc:
                        error = _error(exc)
                wall = time.monotonic() - t0
                results.put((row_name(name, scope), epoch, rank, ids, wall, error))
                barrier.wait(timeout)  # the epoch is over everywhere: the coordinator counts
                barrier.wait(timeout)  # counted: next epoch
            if reader is not None:
                with contextlib.suppress(Exception):
                    reader.close()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        # Out at once: the results are flushed; the interpreter's own exit (joining the
        # readers' leftover thread pools) would only add seconds to every run.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _error(exc: BaseException) -> str:
    traceback.print_exc()
    return f"{type(exc).__name__}: {str(exc)[:300]}"


# ---------------------------------------------------------------------------- the coordinator
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _prepare(b: Bench, cfg: dict[str, Any]) -> dict[str, Any]:
    """The tars, Mosaic's copy of the same samples (if installed) and the sample index."""
    from shardcache import ShardCache
    from shardcache._datasets.sample_index import index_document, learn, write_index

    shards = {
        f"{PREFIX}-{i:06d}.tar": make_shard(cfg["shard_bytes"], cfg["sample"], i)
        for i in range(cfg["shards"])
    }
    put(b.s3, shards)
    urls = [f"s3://{BUCKET}/{key}" for key in shards]
    out: dict[str, Any] = {"urls": urls, "tar_bytes": sum(map(len, shards.values()))}
    try:
        files = peers.write_mds(list(shards.values()), b.fresh_dir("b13mds"), cfg["shard_bytes"])
        put(b.s3, {f"{MDS_PREFIX}/{p.name}": p.read_bytes() for p in files})
        out["mds"] = f"s3://{BUCKET}/{MDS_PREFIX}"
        out["mds_files"] = sum(1 for p in files if p.suffix == ".mds")
        out["mds_bytes"] = sum(p.stat().st_size for p in files)
    except peers.PeerMissing:
        out["mds"] = None
    index = b.fresh_dir("b13index") / "index.json"
    throwaway = ShardCache(b.fresh_dir("b13learn"), storage_options=b.direct)
    write_index(str(index), index_document(learn(urls, throwaway, threads=4), urls))
    out["index"] = str(index)
    return out


def _measure(b: Bench, cfg: dict[str, Any], data: dict[str, Any], readers: list[Any]):
    """Run the ranks over ``readers``; per row and epoch: the requests and what each rank got."""
    counted: dict[str, list[dict[str, Any]]] = {}
    b.s3.clear_requests()
    with counting_proxy(b.s3.port) as (endpoint, take):
        take()
        so = b.s3.storage_options(endpoint)
        ctx = {
            "cfg": cfg,
            "so": so,
            "urls": data["urls"],
            "mds": data["mds"],
            "index": data["index"],
            "work": b.fresh_dir("b13caches"),
            "readers": readers,
            "master_port": _free_port(),
        }
        barrier, results = CTX.Barrier(RANKS + 1), CTX.Queue()
        procs = [
            CTX.Process(target=_rank_main, args=(rank, ctx, barrier, results))
            for rank in range(RANKS)
        ]
        for proc in procs:
            proc.start()
        try:
            for name, _kind, scope, _options in readers:
                for epoch in range(EPOCHS):
                    barrier.wait(cfg["timeout"])
                    got = [results.get(timeout=60) for _ in range(RANKS)]
                    records = take()
                    server_gets = b.gets(PREFIX)
                    b.s3.clear_requests()
                    counted.setdefault(row_name(name, scope), []).append(
                        _epoch_counts(epoch, got, records, server_gets)
                    )
                    barrier.wait(cfg["timeout"])
        except Exception:  # a rank died or hung: the rows so far stand, the rest are errors
            traceback.print_exc()
            barrier.abort()
        finally:
            for proc in procs:
                proc.join(60)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(10)
    return counted


def _epoch_counts(
    epoch: int, got: list[tuple[Any, ...]], records: list[tuple[str, str, int]], server_gets: int
) -> dict[str, Any]:
    by_rank = {rank: ids for _row, _e, rank, ids, _wall, _err in got}
    data = f"/{BUCKET}/{PREFIX}"
    gets = [r for r in records if r[0] == "GET" and r[1].startswith(data)]
    errors = [err for *_, err in got if err]
    if len(gets) != server_gets and not errors:
        errors.append(f"the proxy relayed {len(gets)} GETs, the server logged {server_gets}")
    return {
        "epoch": epoch,
        "gets": server_gets,
        "bytes": sum(r[2] for r in gets),
        "other_requests": sum(1 for r in records if r[0] != "GET"),
        "by_rank": [by_rank.get(rank, []) for rank in range(RANKS)],
        "wall_s": round(max(g[4] for g in got), 2),
        "error": "; ".join(sorted(set(errors))) or None,
    }


def _rows(counted: dict[str, list[dict[str, Any]]], total: int) -> tuple[list, dict[str, str]]:
    """Per row and epoch: the figures; and each row's error, if any."""
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for name, epochs in counted.items():
        previous: list[list[str]] | None = None
        for e in epochs:
            ids = [i for rank_ids in e["by_rank"] for i in rank_ids]
            distinct = len(set(ids))
            if e["error"]:
                errors[name] = e["error"]
            elif distinct != total:
                errors[name] = f"epoch {e['epoch']}: {distinct} distinct samples of {total}"
            same = None
            if previous is not None:
                mine = [
                    len(set(now) & set(before)) / max(len(set(now)), 1)
                    for now, before in zip(e["by_rank"], previous, strict=True)
                ]
                same = round(100 * sum(mine) / len(mine), 1)
            rows.append(
                {
                    "reader": name,
                    "epoch": e["epoch"],
                    "gets": e["gets"],
                    "bytes": e["bytes"],
                    "mb": round(e["bytes"] / MB, 2),
                    "other_requests": e["other_requests"],
                    "samples": len(ids),
                    "distinct": distinct,
                    "order_changed": None if previous is None else e["by_rank"] != previous,
                    "same_rank_pct": same,
                    "wall_s": e["wall_s"],
                }
            )
            previous = e["by_rank"]
    return rows, errors


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row over its 3 epochs: "e0 / e1 / e2" per figure, and the totals."""

    def per_epoch(key: str, fmt=str) -> str:
        return " / ".join(fmt(r[key]) for r in rows)

    def changed(value: bool | None) -> str:
        return "-" if value is None else ("yes" if value else "no")

    return {
        "gets": per_epoch("gets"),
        "mb": per_epoch("mb", lambda v: f"{v:g}"),
        "samples": per_epoch("samples"),
        "order_changed": per_epoch("order_changed", changed),
        "same_rank_pct": per_epoch("same_rank_pct", lambda v: "-" if v is None else f"{v:g}"),
        "gets_total": sum(r["gets"] for r in rows),
        "mb_total": round(sum(r["mb"] for r in rows), 2),
    }


def b13_epochs(b: Bench) -> dict[str, Any]:
    cfg = SIZES[b.size]
    data = _prepare(b, cfg)
    readers = [r for r in READERS if r[1] != "mosaic" or data["mds"] is not None]
    counted = _measure(b, cfg, data, readers)
    total = len(data["urls"]) * samples_per_shard(cfg["shard_bytes"], cfg["sample"])
    rows, errors = _rows(counted, total)
    for name, _kind, scope, _options in readers:  # rows that never reported
        if row_name(name, scope) not in counted:
            errors[row_name(name, scope)] = "did not run (an earlier row failed its job)"
    summaries: dict[str, dict[str, Any]] = {}
    for name, kind, scope, _options in READERS:
        key = row_name(name, scope)
        mine = [r for r in rows if r["reader"] == key]
        if kind == "mosaic" and data["mds"] is None:
            summaries[key] = {"status": f"{NOT_INSTALLED} (mosaicml-streaming)"}
        elif key in errors:
            summaries[key] = {"error": errors[key]}
        else:
            summaries[key] = _summary(mine)
    ours = [row_name("shardcache", scope) for scope in ("rank", "node")]
    caches = {"rank": RANKS, "node": 1}
    ok = not ({*ours} & set(errors))
    for key, scope in zip(ours, ("rank", "node"), strict=True):
        mine = [r for r in rows if r["reader"] == key]
        ok = ok and len(mine) == EPOCHS and all(r["gets"] == 0 for r in mine[1:])
        ok = ok and 0 < mine[0]["gets"] <= len(data["urls"]) + caches[scope] - 1
    shardcache = summaries.pop(ours[0]) if ours[0] in summaries else {"error": "no result"}
    summaries[row_name("mosaic streaming", "rank")] = {"status": MOSAIC_RANK_SCOPE}
    mds = (
        f"Mosaic: the same samples converted by its MDSWriter, {data['mds_files']} MDS shards of "
        f"{data['mds_bytes'] / MB:.1f} MB in all, plus index.json"
        if data["mds"]
        else "Mosaic: not installed"
    )
    return {
        "what": f"{len(data['urls'])} tar shards of "
        f"{data['tar_bytes'] / len(data['urls']) / MB:.2f} MB ({total} samples of "
        f"{cfg['sample'] / 1000:g} kB, {data['tar_bytes'] / MB:.1f} MB); "
        f"{mds}. {RANKS} ranks (processes, gloo) x {WORKERS} DataLoader workers, batch "
        f"{cfg['batch']}, {EPOCHS} epochs per reader, one node; rank scope = a cache dir per "
        "rank, node scope = one shared by both ranks; unshaped link through a counting proxy. "
        "Per reader: GETs / MB of GET bodies / samples / order changed / % of a rank's samples "
        "it also had the epoch before, for epochs 0 / 1 / 2 (shardcache: rank scope, index "
        "made ahead; its node-scope and index-learned rows among the peers)",
        "shardcache": shardcache,
        "peers": summaries,
        "rows": rows,
        "ratio": None,
        "row_errors": errors,
        "target": "shardcache (index made ahead): no GET in epochs 1 and 2 at rank and node "
        "scope; epoch 0 fetches each shard once per cache that reads it",
        "verdict": verdict(ok),
    }
