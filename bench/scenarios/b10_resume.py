"""B10: resuming mid-epoch from a checkpoint, against an uninterrupted run and a naive resume.

The requirement: resuming never decodes skipped samples; it skips tar members by their
headers, from the local cache when the shard is there; at 90% of an epoch of at least a
million small samples it takes seconds, warm and cold, not minutes.

Data. ``shards`` x ``samples`` one-member samples (``s<shard>-<i>.cls``, one byte: a tar
member is a 512-byte header and one 512-byte block, so a sample is 1 KiB on disk). At full
size 100 x 10,000 = 1,000,000 samples in ~1 GB of shards of ~10 MiB, uploaded one at a time
to the harness's moto server (the tars are written directly, header by header: tarfile
would take most of a minute). Small samples are the hard case for a resume: the work
before the resume point is per sample (headers), not per byte. Tiny size (the smoke
test): 6 x 500 samples, batches of 32, a buffer of 100: the plumbing, not the figures.

Reader. What a training job uses, the same in every row: ``ResumableDataset(seed=0,
shuffle_buffer=buffer)`` under torchdata's ``StatefulDataLoader(batch_size=batch,
num_workers=2)`` (forked workers), a collate that keeps the sample keys only (nothing is
decoded anywhere), so the rows compare reading and skipping, not a model. The cache's
default prefetch threads.

Rows, per repetition (the uninterrupted run first, the others alternate their order):

- *uninterrupted* (peer): a whole epoch from a warm cache (the shards fetched into it
  before any clock, direct to the server; then one untimed epoch warms the page cache).
  Its rate (samples/s, from creating the loader's iterator to the end) and the time its last
  10% took (from the batch at 90% to the end). At that batch (90% of the epoch's batches,
  a batch boundary) it takes ``loader.state_dict()``, JSON round-tripped as a checkpoint is.
- *resume warm* (shardcache): from the checkpoint's text to the first batch
  (``json.loads``, a new dataset and loader, ``load_state_dict``, the workers' start, the
  seeks, the shuffle buffer read again from its offsets) and to the end of the epoch, on
  the same warm cache. Its rate over the rest of the epoch is compared with the
  uninterrupted run's (``ratio``), its time with the uninterrupted last 10%
  (``resume_overhead_s``: what resuming costs beyond the samples themselves).
- *resume cold* (shardcache, reported among the peers: the table has one shardcache
  column): the same checkpoint, a fresh empty cache directory, the shards from S3 over the
  shaped link the other cold scenarios use (B2, B3, B6, B7, B9: first-byte latency,
  per-connection and aggregate rates; unshaped, moto would serve a shard in milliseconds
  and the row would say nothing about a real store): a restarted job on a new node. It
  counts the GETs: only the shards left to read, and those of the samples that sat in the
  shuffle buffers (fetched whole, before the first batch).
- *naive resume* (peer): what WebDataset users do without offsets: the same pipeline
  (``wds.WebDataset`` over the same shard files of the warm cache, on local disk, in the
  epoch's shard order, each worker the same shards as its consumer, ``.shuffle(buffer)``)
  reads and discards, in each worker, the samples that worker had delivered (its count in
  the checkpoint; their sum is checked against the batches delivered) with
  ``itertools.islice`` (webdataset's tar expansion reads the bytes, nothing is decoded),
  under the same StatefulDataLoader, workers, batch size and collate. Timed to its first
  batch after the skip: the time to reach the resume point. (torchdata's own fallback for a
  dataset without ``state_dict`` is slower still: it replays every skipped batch through
  the workers, the collate and the queue.)

Checks, not numbers: the resumed runs (warm and cold) must deliver exactly the keys the
uninterrupted run delivered after the checkpoint, in the same order; a difference is
reported as an error in that row (and ``row_errors``), never as a time.

Target: the resume at 90% (warm and cold) reaches its first batch in <= 10 s and finishes
the epoch's last 10% within 10 s of the uninterrupted last 10% (seconds, not minutes).
The rates' ratio (resumed / uninterrupted samples/s) is reported, not judged: the cold
one is the link's, not the reader's.
"""

from __future__ import annotations

import gc
import itertools
import json
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data

from bench.support.common import Bench, new_cache, verdict
from bench.support.infra import BUCKET, MB, CpuMeter, median, put

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"shards": 6, "samples": 500, "batch": 32, "workers": 2, "buffer": 100},
    "full": {"shards": 100, "samples": 10_000, "batch": 256, "workers": 2, "buffer": 1000},
}
FRACTION = 0.9  # where the checkpoint is taken, in the epoch's batches
SECONDS = 10.0  # target: time to the first batch, and overhead over the uninterrupted last 10%
SEED = 0
LOADER_TIMEOUT = 600.0  # a worker may take this long for one batch (the naive skip included)


# ---------------------------------------------------------------------------- data
def _header(name: bytes, size: int) -> bytes:
    """A ustar header block of a regular file ``name`` of ``size`` bytes (mtime 0)."""
    h = bytearray(512)
    h[: len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"00000000000\0"
    h[148:156] = b" " * 8
    h[156:157] = b"0"
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def make_shard(shard: int, samples: int) -> bytes:
    """``samples`` one-member samples ``s<shard>-<i>.cls`` (one byte each), ustar."""
    parts = []
    for i in range(samples):
        parts.append(_header(b"s%04d-%06d.cls" % (shard, i), 1))
        parts.append(b"%d" % (i % 10) + b"\0" * 511)
    parts.append(b"\0" * 1024)  # end of archive
    return b"".join(parts)


def _upload(b: Bench, shards: int, samples: int) -> tuple[list[str], int]:
    nbytes = 0
    urls = []
    for i in range(shards):  # one at a time: the client never holds the whole bucket
        key = f"b10-{i:06d}.tar"
        data = make_shard(i, samples)
        nbytes += len(data)
        put(b.s3, {key: data})
        urls.append(f"s3://{BUCKET}/{key}")
    return urls, nbytes


# ---------------------------------------------------------------------------- readers
def _keys(batch: list[dict[str, Any]]) -> list[str]:
    return [sample["__key__"] for sample in batch]


def _loader(dataset: Any, cfg: dict[str, Any]) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(
        dataset,
        batch_size=cfg["batch"],
        num_workers=cfg["workers"],
        collate_fn=_keys,
        multiprocessing_context="fork",
        timeout=LOADER_TIMEOUT,
    )


def _dataset(urls: list[str], cache: Any, cfg: dict[str, Any], index: str | None = None) -> Any:
    import shardcache

    return shardcache.ResumableDataset(
        urls, seed=SEED, shuffle_buffer=cfg["buffer"], cache=cache, index=index
    )


def _uninterrupted(urls: list[str], cache: Any, cfg: dict[str, Any], at: int) -> dict[str, Any]:
    """One epoch; the checkpoint (JSON text) after batch ``at``; every key after it."""
    loader = _loader(_dataset(urls, cache, cfg), cfg)
    state = None
    delivered: list[list[str]] = []
    t0 = time.monotonic()
    t_at = t0
    for keys in loader:
        delivered.append(keys)
        if len(delivered) == at:
            t_at = time.monotonic()
            state = json.dumps(loader.state_dict())
    end = time.monotonic()
    if state is None:
        raise RuntimeError(f"the epoch had {len(delivered)} batches, fewer than {at}")
    n = sum(len(keys) for keys in delivered)
    distinct = len({k for keys in delivered for k in keys})
    return {
        "wall": end - t0,
        "last_wall": end - t_at,
        "samples": n,
        "distinct": distinct,
        "state": state,
        "after": delivered[at:],
        "to_point": t_at - t0,
    }


def _resume(
    urls: list[str], cache: Any, cfg: dict[str, Any], state: str, index: str
) -> dict[str, Any]:
    """From the checkpoint's text to the first batch and to the end of the epoch."""
    t0 = time.monotonic()
    loader = _loader(_dataset(urls, cache, cfg, index), cfg)
    loader.load_state_dict(json.loads(state))
    first = None
    keys: list[list[str]] = []
    for batch in loader:
        if first is None:
            first = time.monotonic() - t0
        keys.append(batch)
    end = time.monotonic() - t0
    return {"first": first if first is not None else end, "wall": end, "keys": keys}


class _NaiveResume(torch.utils.data.IterableDataset):
    """WebDataset's pipeline resumed by reading and discarding: each DataLoader worker
    skips (``islice``) the samples its consumer had delivered, then yields the rest."""

    def __init__(self, paths: list[list[str]], skip: list[int], buffer: int) -> None:
        self.paths, self.skip, self.buffer = paths, skip, buffer  # paths: each worker's

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import webdataset as wds

        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        ds = wds.WebDataset(
            self.paths[worker],
            shardshuffle=False,
            nodesplitter=None,
            workersplitter=None,
            empty_check=False,
        ).shuffle(self.buffer, seed=SEED)
        it = iter(ds)
        next(itertools.islice(it, self.skip[worker], self.skip[worker]), None)  # discard
        return it


def _naive(paths: list[list[str]], skip: list[int], cfg: dict[str, Any]) -> dict[str, Any]:
    children = len(multiprocessing.active_children())
    t0 = time.monotonic()
    loader = _loader(_NaiveResume(paths, skip, cfg["buffer"]), cfg)
    it = iter(loader)
    batch = next(it)
    first = time.monotonic() - t0
    # The loader keeps its iterator (for state_dict): both go, and the workers are joined
    # before the CPU meter stops (a joined worker's CPU counts as the client's).
    del it, loader
    gc.collect()
    if len(multiprocessing.active_children()) > children:
        raise RuntimeError("the naive resume's DataLoader workers are still running")
    return {"first": first, "batch": len(batch)}


def _delivered(state: str, workers: int) -> list[int]:
    """Samples each worker's consumer had delivered, from a StatefulDataLoader state."""
    snapshot = json.loads(state)["_snapshot"]["_worker_snapshots"]
    return [int(snapshot[f"worker_{w}"]["dataset_state"]["delivered"]) for w in range(workers)]


# ---------------------------------------------------------------------------- scenario
def _check(name: str, got: list[list[str]], want: list[list[str]]) -> str | None:
    flat_got = [k for batch in got for k in batch]
    flat_want = [k for batch in want for k in batch]
    if flat_got == flat_want:
        return None
    first = next(
        (i for i, (g, w) in enumerate(zip(flat_got, flat_want, strict=False)) if g != w),
        min(len(flat_got), len(flat_want)),
    )
    return (
        f"{name} delivered {len(flat_got)} samples, the uninterrupted run {len(flat_want)} "
        f"after the checkpoint; they differ from position {first}"
    )


def _measure(b: Bench, cfg: dict[str, Any], urls: list[str], at: int) -> dict[str, Any]:
    """Every row, ``reps`` times: the uninterrupted run first (it makes the checkpoint),
    then the three resumes in alternating order. Wrong results go to ``errors``."""
    warm = new_cache(b.fresh_dir("b10"), b.direct)
    for url in urls:  # the warm cache, before any clock
        warm.fetch(url)
    # A restarted job carries the sample index (made once, beside the shards): without it
    # the dataset would learn it by fetching every shard first.
    from shardcache._datasets.resume_start import plan_for as fresh_plan
    from shardcache._datasets.sample_index import index_document, learn, write_index

    index = str(b.fresh_dir("b10i") / "index.json")
    write_index(index, index_document(learn(urls, warm, threads=4), urls))
    # The naive resume reads, in each worker, the shards of that worker's plan in order.
    plan_for = fresh_plan(_dataset(urls, warm, cfg, index)._epoch_split(), 0)
    workers = cfg["workers"]
    ordered = [
        list(
            dict.fromkeys(str(warm.path_for(urls[p.shard])) for p in plan_for(workers, workers, w))
        )
        for w in range(workers)
    ]
    total = cfg["shards"] * cfg["samples"]
    pids = {"server": b.server_pid}
    _uninterrupted(urls, warm, cfg, at)  # untimed: the page cache, the workers' imports
    runs: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    gets: list[int] = []
    with b.link() as (so, link_pids):
        for rep in range(b.cfg["reps"]):
            with CpuMeter(pids) as m:
                u = _uninterrupted(urls, warm, cfg, at)
            runs.setdefault("uninterrupted", []).append(u | m.result)
            if u["samples"] != total or u["distinct"] != total:
                errors["uninterrupted"] = (
                    f"{u['samples']} samples ({u['distinct']} distinct) in the epoch, not {total}"
                )
            elif u["after"] != runs["uninterrupted"][0]["after"]:
                errors["uninterrupted"] = f"repetition {rep} delivered another order than the first"
            state, skip = u["state"], _delivered(u["state"], cfg["workers"])
            if sum(skip) != at * cfg["batch"]:  # the state's counts: what the naive skips
                errors["naive"] = f"the workers' states delivered {skip}, not {at} batches"

            def cold(state: str = state) -> dict[str, Any]:
                b.s3.clear_requests()
                r = _resume(urls, new_cache(b.fresh_dir("b10c"), so), cfg, state, index)
                gets.append(b.gets("b10-"))
                return r

            rows: dict[str, tuple[Callable[[], dict[str, Any]], dict[str, int]]] = {
                "resume warm": (lambda state=state: _resume(urls, warm, cfg, state, index), pids),
                "resume cold": (cold, link_pids),
                "naive": (lambda skip=skip: _naive(ordered, skip, cfg), pids),
            }
            for name in list(rows) if rep % 2 == 0 else list(reversed(rows)):
                fn, meter_pids = rows[name]
                with CpuMeter(meter_pids) as m:
                    r = fn()
                runs.setdefault(name, []).append(r | m.result)
                err = _check(name, r["keys"], u["after"]) if "keys" in r else None
                if name == "naive" and r["batch"] != cfg["batch"]:
                    err = f"the first batch after the skip has {r['batch']} samples"
                if err:
                    errors[name] = err
                    print(f"B10 row {name!r} FAILED: {err}", file=sys.stderr, flush=True)
    return {"runs": runs, "errors": errors, "gets": gets}


def _cpu(rs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: round(median([r[k] for r in rs]), 1) for k in rs[0] if k.endswith("_cpu_pct")}


def _wall(rs: list[dict[str, Any]], key: str = "wall") -> float:
    return median([r[key] for r in rs])


def b10_resume(b: Bench) -> dict[str, Any]:
    cfg = SIZES[b.size]
    total = cfg["shards"] * cfg["samples"]
    urls, nbytes = _upload(b, cfg["shards"], cfg["samples"])
    per_worker = -(-total // cfg["workers"])
    batches = cfg["workers"] * -(-per_worker // cfg["batch"])
    at = int(batches * FRACTION)
    measured = _measure(b, cfg, urls, at)
    runs, errors = measured["runs"], measured["errors"]

    un = runs["uninterrupted"]
    epoch_s, last_s = _wall(un), _wall(un, "last_wall")
    rest = sum(len(batch) for batch in un[0]["after"])
    rate = total / epoch_s
    rows: dict[str, dict[str, Any]] = {}
    overhead: dict[str, float] = {}
    for tag in ("warm", "cold"):
        rs = runs[f"resume {tag}"]
        wall = _wall(rs)
        rows[tag] = {
            "first_batch_s": round(_wall(rs, "first"), 2),
            "finish_s": round(wall, 2),
            "samples_s": round(rest / wall),
            "vs_last_10pct": round(wall / last_s, 2),  # time: resumed / uninterrupted
            **_cpu(rs),
        }
        overhead[tag] = round(wall - last_s, 2)  # may be < 0: within the runs' spread
        if f"resume {tag}" in errors:
            rows[tag] = {"error": errors[f"resume {tag}"]}
    if "error" not in rows["cold"]:
        rows["cold"]["gets"] = max(measured["gets"])
    naive_name = "naive resume: webdataset + islice, same workers and files (warm)"
    peers: dict[str, dict[str, Any]] = {
        "shardcache resume cold (fresh cache, shaped link)": rows["cold"],
        "uninterrupted epoch (warm)": {
            "epoch_s": round(epoch_s, 2),
            "samples_s": round(rate),
            "to_90pct_s": round(_wall(un, "to_point"), 2),
            "last_10pct_s": round(last_s, 2),
            "last_10pct_samples_s": round(rest / last_s),
            **_cpu(un),
        },
        naive_name: {"to_resume_point_s": round(_wall(runs["naive"], "first"), 2)}
        | _cpu(runs["naive"]),
    }
    for name, key in (("uninterrupted", "uninterrupted epoch (warm)"), ("naive", naive_name)):
        if name in errors:
            peers[key] = {"error": errors[name]}
    first = _wall(runs["resume warm"], "first")
    slowest_first = max(first, _wall(runs["resume cold"], "first"))
    ok = not errors and slowest_first <= SECONDS and max(overhead.values()) <= SECONDS
    # Figures of a run that delivered the wrong samples are not reported (its row says why).
    figures: dict[str, Any] = {"ratio": None}
    if not ({"uninterrupted", "resume warm"} & set(errors)):
        figures["ratio"] = round(rest / _wall(runs["resume warm"]) / rate, 3)
        figures["resume_overhead_warm_s"] = overhead["warm"]
        if "naive" not in errors:
            figures["speedup_vs_naive"] = round(_wall(runs["naive"], "first") / first, 2)
    if not ({"uninterrupted", "resume cold"} & set(errors)):
        figures["cold_ratio"] = round(rest / _wall(runs["resume cold"]) / rate, 3)
        figures["resume_overhead_cold_s"] = overhead["cold"]
    return {
        "what": f"{cfg['shards']} x {nbytes / cfg['shards'] / MB:.1f} MB shards, {total} "
        f"one-member samples (1 KiB each), ResumableDataset(shuffle_buffer={cfg['buffer']}) "
        f"under StatefulDataLoader(batch_size={cfg['batch']}, num_workers={cfg['workers']}), "
        f"keys only (no decode); checkpoint after batch {at} of {batches} ({FRACTION:.0%}), "
        f"{rest} samples left; warm: the cache filled and one untimed epoch before; cold: a "
        f"fresh cache, link: {b.cfg['link'].describe()}; resumed keys checked equal to the "
        "uninterrupted run's. shardcache: the warm resume; ratio: its samples/s over the "
        "rest / the uninterrupted epoch's (cold_ratio: the same, cold); resume_overhead: its "
        "time for the rest - the uninterrupted last 10% (s); speedup_vs_naive: the naive time "
        "to the resume point / the warm resume's to its first batch",
        "shardcache": rows["warm"],
        "peers": peers,
        **figures,
        "row_errors": errors,
        "target": f"resume at {FRACTION:.0%} of >= 1M samples in seconds (warm and cold), not "
        f"minutes: first batch <= {SECONDS:g} s and the rest of the epoch <= {SECONDS:g} s "
        "over the uninterrupted last 10%; resumed keys = the uninterrupted run's",
        "verdict": verdict(ok),
    }
