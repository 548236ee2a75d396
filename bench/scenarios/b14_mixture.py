"""B14: what mixing costs, a MixtureDataset against one ResumableDataset over the same shards.

The question: does interleaving several sources sample by sample (``next_source``, a
generator layer, the ``"__source__"`` tag) slow a training loop's input? The network is
not what is measured: every shard is in the cache (fetched before anything is timed) and
read from the page cache, so what is left is the readers' own CPU per sample.

Data. ``sum(split)`` tar shards (``support.infra.make_shard``) of ``per_shard`` samples, each a
``.bin`` of ``sample`` random bytes and a ``.cls``: small samples, so that a per-sample cost
shows (at full size 24 shards of 2,500 samples of 4 kB). The same bucket, the same cache.

Readers, each iterated in this process (no DataLoader: ``num_workers=0``), every sample
counted and nothing decoded, the same ``seed``, ``threads``, cache and rank (0 of 1):

- *one source* (peer): ``ResumableDataset(all shards)``.
- *mixture* (shardcache): ``MixtureDataset`` of 3 ``Source`` s splitting the same shards
  (``split`` shards each, in order), each weighted by its samples, ``epoch_size`` = all the
  samples: each source gets exactly its own samples, so an epoch delivers every sample
  once, as the one source does. Each source runs its own prefetch threads (``threads``
  each), as documented.

Before the clock, one epoch of each reader (epoch 0) learns the sample offsets through the
cache and warms the page cache; its samples must be every sample once in both readers,
and the mixture's ``"__source__"`` tags must count each source's samples, else the row is
an error.
Then ``reps`` repetitions, the readers' order alternated, each a whole epoch
(``set_epoch``, a new shard order) timed from ``iter()`` to the last sample.

Figures: medians of samples/s and of CPU per sample (the process's, its threads
included: steadier than the wall clock when other jobs share the cores); ``ratio`` the
median of each repetition's mixture / one source samples/s (paired runs, so drift and
other jobs hit both alike), ``cpu_ratio`` the same of one source's CPU per sample / the
mixture's; ``mixing_cpu_us_per_sample`` the CPU the mixing adds to a sample, from the
medians.

The mixture's order (which source each sample comes from,
:func:`shardcache._datasets.interleave.picks`) is computed once for a consumer's shares and
kept: the untimed epoch computes it, the timed ones read it. A DataLoader's workers are new
processes every epoch (non-persistent, as ``ResumableDataset`` requires): the first epoch's
workers compute theirs and keep them in the cache root, later epochs' read them, unless the
training process computed them for the workers (``MixtureDataset.prepare(workers=)``):
``order_cpu_us_per_sample`` is the computing, measured apart (the order computed afresh).

With workers (``workers``): the same readers through a DataLoader of 2 forked workers
(``batch_size=64``, each batch collated to its length: the readers' work, not the
DataLoader's pickling), ``reps`` epochs each, order alternated, CPU per sample of the
training process and its workers (``RUSAGE_CHILDREN``: non-persistent workers are reaped
at the end of every epoch):
one source, the mixture without ``prepare(workers=)`` (its workers compute their orders in
the first of these epochs and read them from the cache root in the others), and the mixture
prepared with ``prepare(workers=2)``. ``workers_order_cpu_pct`` is what the workers' own
orders cost a sample (unprepared - prepared, in % of the prepared mixture's CPU a sample).

Targets, each with its own verdict (``verdicts``; ``verdict`` is met when both are): the
mixing costs <= 5 % in one process (``ratio`` >= 0.95), and with workers the prepared
mixture costs <= 1 % more CPU a sample than one source (``workers_mixing_cpu_pct`` <= 1).
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from bench.support.common import Bench, new_cache, timed, verdict
from bench.support.infra import BUCKET, make_shard, median, put
from shardcache._datasets import interleave

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"split": (3, 2, 1), "per_shard": 40, "sample": 4000, "threads": 2, "reps": 1},
    "full": {"split": (12, 8, 4), "per_shard": 2500, "sample": 4000, "threads": 4, "reps": 7},
}
SEED = 0
TARGET = 0.95
WORKERS_TARGET_PCT = 1.0  # with workers, the prepared mixture's CPU a sample over one source's
WORKERS = 2
ONE = "one ResumableDataset over the same shards"


def _upload(b: Bench, cfg: dict[str, Any]) -> list[str]:
    urls = []
    size = cfg["per_shard"] * (
        cfg["sample"] + 1536
    )  # bench.support.infra.samples_per_shard's inverse
    for i in range(sum(cfg["split"])):  # one at a time: the client never holds them all
        key = f"b14-{i:06d}.tar"
        put(b.s3, {key: make_shard(size, cfg["sample"], i)})
        urls.append(f"s3://{BUCKET}/{key}")
    return urls


def _readers(cfg: dict[str, Any], urls: list[str], cache: Any) -> dict[str, Any]:
    import shardcache

    common = {"seed": SEED, "cache": cache, "threads": cfg["threads"], "rank": 0, "world_size": 1}
    sources, start = [], 0
    for i, count in enumerate(cfg["split"]):
        part = urls[start : start + count]
        start += count
        sources.append(shardcache.Source(part, weight=count * cfg["per_shard"], name=f"s{i}"))
    total = len(urls) * cfg["per_shard"]
    return {
        "mixture": shardcache.MixtureDataset(sources, epoch_size=total, **common),
        ONE: shardcache.ResumableDataset(urls, **common),
    }


def _cpu_with_children() -> float:
    """CPU seconds of this process and of its reaped children (DataLoader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _with_workers(
    cfg: dict[str, Any], urls: list[str], cache: Any, first_epoch: int
) -> dict[str, list[float]]:
    """CPU per sample (us, each of ``reps`` epochs) of each reader through a DataLoader of
    2 forked workers; the mixture with and without ``prepare(workers=2)``."""
    from torch.utils.data import DataLoader

    readers = _readers(cfg, urls, cache)
    prepared = _readers(cfg, urls, cache)["mixture"].prepare(workers=WORKERS)
    readers[ONE].prepare()
    readers["mixture"].prepare()
    readers = {ONE: readers[ONE], "mixture": readers["mixture"], "mixture, prepared": prepared}
    total = len(urls) * cfg["per_shard"]
    cpu: dict[str, list[float]] = {name: [] for name in readers}
    for rep in range(cfg["reps"]):
        names = list(readers) if rep % 2 == 0 else list(reversed(readers))  # alternate
        for name in names:
            reader = readers[name]
            reader.set_epoch(first_epoch + rep)
            interleave.forget_orders()  # the workers inherit no order from this process
            loader = DataLoader(
                reader, batch_size=64, num_workers=WORKERS, collate_fn=len, timeout=300
            )
            start = _cpu_with_children()
            count = sum(loader)
            cpu[name].append((_cpu_with_children() - start) / total * 1e6)
            if count != total:
                raise RuntimeError(f"{name} with workers: {count} samples, expected {total}")
    return cpu


def _count(samples: Iterable[Any]) -> int:
    n = 0
    for _ in samples:
        n += 1
    return n


def _check_first_epoch(readers: dict[str, Any], cfg: dict[str, Any]) -> str | None:
    """Epoch 0 of each reader, untimed: every sample once, each source its own samples."""
    seen: dict[str, list[tuple[str, str]]] = {}
    tags: Counter[str] = Counter()
    for name, reader in readers.items():
        reader.set_epoch(0)
        seen[name] = []
        for sample in reader:
            seen[name].append((sample["__url__"], sample["__key__"]))
            tags[sample.get("__source__", "")] += 1
    total = sum(cfg["split"]) * cfg["per_shard"]
    for name, ids in seen.items():
        if len(ids) != total or len(set(ids)) != total:
            return f"{name}: {len(set(ids))} distinct of {len(ids)} samples, expected {total}"
    if sorted(seen["mixture"]) != sorted(seen[ONE]):
        return "the mixture and the one source delivered different samples"
    expected = {f"s{i}": n * cfg["per_shard"] for i, n in enumerate(cfg["split"])}
    if {k: v for k, v in tags.items() if k} != expected:
        return f"the mixture's samples per source {dict(tags)}, expected {expected}"
    return None


def b14_mixture(b: Bench) -> dict[str, Any]:
    cfg = SIZES[b.size]
    urls = _upload(b, cfg)
    cache = new_cache(b.fresh_dir("b14"), b.direct)
    for url in urls:  # hot: nothing below goes to the server
        cache.fetch(url)
    readers = _readers(cfg, urls, cache)
    for reader in readers.values():
        reader.prepare()
    error = _check_first_epoch(readers, cfg)
    total = len(urls) * cfg["per_shard"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in readers}
    for rep in range(cfg["reps"]):
        order = list(readers) if rep % 2 == 0 else list(reversed(readers))  # alternate
        for name in order:
            readers[name].set_epoch(rep + 1)
            cpu = time.process_time()  # this process, its threads included
            run = timed(lambda name=name: _count(readers[name]), {})
            cpu_us = (time.process_time() - cpu) / total * 1e6
            if run["out"] != total and error is None:
                error = f"{name}: {run['out']} samples in epoch {rep + 1}, expected {total}"
            runs[name].append(run | {"samples_s": total / run["wall"], "cpu_us": cpu_us})

    def summ(rs: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "samples_s": round(median([r["samples_s"] for r in rs])),
            "wall_s": round(median([r["wall"] for r in rs]), 3),
            "cpu_us_per_sample": round(median([r["cpu_us"] for r in rs]), 2),
            "machine_cpu_pct": round(median([r["machine_cpu_pct"] for r in rs]), 1),
            "client_cpu_pct": round(median([r["client_cpu_pct"] for r in rs]), 1),
        }

    mixed, one = summ(runs["mixture"]), summ(runs[ONE])
    ratios = [
        m["samples_s"] / o["samples_s"] for m, o in zip(runs["mixture"], runs[ONE], strict=True)
    ]
    ratio = median(ratios)
    cpu_ratio = median(
        [o["cpu_us"] / m["cpu_us"] for m, o in zip(runs["mixture"], runs[ONE], strict=True)]
    )
    split = " + ".join(str(n) for n in cfg["split"])
    shares = tuple(cfg["split"][i] * cfg["per_shard"] for i in range(len(cfg["split"])))
    interleave.forget_orders()
    cpu = time.process_time()
    interleave.order(shares)
    order_us = (time.process_time() - cpu) / total * 1e6
    runs_with_workers = _with_workers(cfg, urls, cache, cfg["reps"] + 1)
    workers = {name: round(median(values), 2) for name, values in runs_with_workers.items()}
    paired = [  # each epoch's prepared mixture against the one source's of the same repetition
        round(100 * (m - o) / o, 1)
        for m, o in zip(runs_with_workers["mixture, prepared"], runs_with_workers[ONE], strict=True)
    ]
    prepared = workers["mixture, prepared"]
    order_pct = 100 * (workers["mixture"] - prepared) / prepared
    mixing_pct = 100 * (prepared - workers[ONE]) / workers[ONE]
    checks = {"mixing": ratio >= TARGET, "workers": round(mixing_pct, 1) <= WORKERS_TARGET_PCT}
    return {
        "what": f"{len(urls)} shards of {cfg['per_shard']} samples of {cfg['sample'] / 1000:g} kB "
        f"({total} samples), hot cache (fetched before the clock, one untimed epoch each "
        f"first), in-process (num_workers=0, no DataLoader), threads={cfg['threads']}, "
        f"samples counted, nothing decoded; shardcache: MixtureDataset of 3 sources of "
        f"{split} shards, weights = their samples, epoch_size = all samples; peer: one "
        f"ResumableDataset over all the shards; both every sample once an epoch; medians of "
        f"{cfg['reps']} epochs, order alternated; ratio: median of the paired mixture / one "
        "source samples/s (cpu_ratio: of CPU per sample, the process's)",
        "shardcache": mixed,
        "peers": {ONE: one},
        "ratio": round(ratio, 3),
        "ratios": [round(r, 3) for r in ratios],
        "cost_pct": round(100 * (1 - ratio), 1),
        "cpu_ratio": round(cpu_ratio, 3),
        "mixing_cpu_us_per_sample": round(mixed["cpu_us_per_sample"] - one["cpu_us_per_sample"], 2),
        "order_cpu_us_per_sample": round(order_us, 2),
        "workers": {
            "what": f"DataLoader of {WORKERS} forked workers, batch_size=64 collated to its "
            f"length, {cfg['reps']} epochs each; CPU per sample (us, the training process and "
            "its workers); the mixture's workers computing their order in the first epoch and "
            f"reading it from the cache root after, or handed it by prepare(workers={WORKERS})",
            "cpu_us_per_sample": workers,
            "workers_order_cpu_pct": round(order_pct, 1),
            "workers_mixing_cpu_pct": round(mixing_pct, 1),
            "workers_mixing_cpu_pct_runs": paired,
        },
        "target": "mixing costs <= 5 %: mixture samples/s >= 0.95 x one source's; with "
        "DataLoader workers, the prepared mixture's CPU a sample <= 1 % over one source's",
        "verdicts": {name: verdict(ok) for name, ok in checks.items()},
        "verdict": verdict(error is None and all(checks.values())),
        "row_errors": {"mixture": error} if error else {},
    }
