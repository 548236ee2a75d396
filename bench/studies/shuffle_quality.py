"""Shuffle quality of ResumableDataset's epochs against a global shuffle and no shuffle.

    python -m bench.studies.shuffle_quality [--shards 1000 --samples 100 --ranks 8 --workers 4 ...]

The measure is Mosaic Streaming's (its simulator's "shuffle quality", docs
fundamentals/simulator.md: "the entropy calculated over the probability distribution of
differences between neighboring sample indices and shard indices"): take the samples in the
order training consumes them, each as its index in the unshuffled dataset (shards laid end
to end) and as its shard's index; the entropy in bits of the distribution of the absolute
differences between neighbours, of the sample indices plus of the shard indices. The order
training consumes is Mosaic's too: step after step (a DataLoader takes its workers' batches
in turn), each step the ranks' batches in rank order (nodes, then ranks).

ResumableDataset's order is computed with the library itself, without tar files: each consumer's
pieces from ``shardcache._datasets.epoch_split.EpochSplit.fresh`` (the shards as runs of sample
offsets), then the seeded shuffle buffer of ``shardcache._datasets.shuffle_buffer.ShuffleBuffer``
with the draws ``RandomDraws(seed, epoch, "", consumers, slot)`` the dataset uses; each worker cuts
its samples into batches of ``batch``. The bounds: the same split with ``shuffle_shards=False`` and
no buffer (no shuffle), and a uniformly random permutation of all samples (a global shuffle);
``of_global`` places a figure between them (0 no shuffle, 1 global). Two more figures: the distinct
shards in a global batch (ranks x batch samples), and how many of a rank's samples it also had in
the previous epoch (a global shuffle: 1 / ranks; a split that keeps each cache's shards: all of them
at rank scope; ``shuffle_scope="global"`` deals the shards anew each epoch). Mosaic's own
algorithms are added when ``streaming`` is importable (its partition
and shuffle functions, default block size, canonical nodes = physical nodes).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from itertools import accumulate
from types import SimpleNamespace
from typing import Any

import numpy as np

from bench.support.infra import table_main
from shardcache._datasets.epoch_split import EpochSplit
from shardcache._datasets.resume_plan import RandomDraws
from shardcache._datasets.shuffle_buffer import ShuffleBuffer

Order = Callable[[int], list[list[np.ndarray]]]  # epoch -> per rank, its samples in order


def entropy_of_steps(ids: np.ndarray) -> float:
    """Bits of entropy of the absolute differences between neighbours (Mosaic's measure)."""
    counts = np.bincount(np.abs(np.diff(ids)))
    p = counts[counts > 0] / (len(ids) - 1)
    return float(-(p * np.log2(p)).sum())


def quality(order: np.ndarray, shard_of: np.ndarray) -> float:
    return entropy_of_steps(order) + entropy_of_steps(shard_of[order])


class Dataset:
    """``shards`` x ``samples`` samples, ranks x workers consumers, batches of ``batch``."""

    def __init__(self, shards: int, samples: int, ranks: int, workers: int, batch: int) -> None:
        self.shards, self.samples = shards, samples
        self.ranks, self.workers, self.batch = ranks, workers, batch
        self.total = shards * samples
        self.first = [0, *accumulate([samples] * shards)]  # sample index of each shard's first
        self.shard_of = np.repeat(np.arange(shards), samples)
        self.starts = [tuple(range(0, samples * 1024, 1024))] * shards  # any offsets will do

    def global_order(self, per_rank: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
        """The order training consumes: per step, each rank's batch of that step; a rank's
        steps take its workers' batches in turn."""
        steps: list[list[np.ndarray]] = []
        for worker_seqs in per_rank:
            batches = [
                [seq[i : i + self.batch] for i in range(0, len(seq), self.batch)]
                for seq in worker_seqs
            ]
            rank_steps = [
                b[k] for k in range(max(map(len, batches))) for b in batches if k < len(b)
            ]
            steps.append(rank_steps)
        ordered = [rank[k] for k in range(max(map(len, steps))) for rank in steps if k < len(rank)]
        return np.concatenate(ordered)

    def shardcache(
        self, *, per_node: int | None, buffer: int, shuffle: bool, seed: int, scope: str = "cache"
    ) -> Order:
        """ResumableDataset at rank scope (``per_node`` None) or node scope, with its
        ``shuffle_scope``."""
        split = EpochSplit(self.starts, seed=seed, shuffle=shuffle, remainder="pad", scope=scope)
        consumers = self.ranks * self.workers
        per_unit = self.workers * (per_node or 1)

        def consumer(epoch: int, slot: int) -> np.ndarray:
            ids: list[int] = []
            for piece in split.fresh(epoch, consumers, per_unit, slot).pieces:
                run = split.run_of(piece)
                ids.extend(
                    range(self.first[run.shard] + run.first, self.first[run.shard] + run.stop)
                )
            if buffer == 0:
                return np.array(ids)
            progress = SimpleNamespace(buffer_size=buffer, buffer=[], draws=0)
            shuffler = ShuffleBuffer(progress, RandomDraws(seed, epoch, "", consumers, slot))
            out = [s for i in ids if (s := shuffler.add({"position": i, "sample": i})) is not None]
            while (s := shuffler.drain_one()) is not None:
                out.append(s)
            return np.array(out)

        return lambda epoch: [
            [consumer(epoch, r * self.workers + w) for w in range(self.workers)]
            for r in range(self.ranks)
        ]

    def global_shuffle(self, seed: int) -> Order:
        """A uniformly random permutation of every sample, dealt in the same consumption
        order (so each rank's share is random too)."""

        def order(epoch: int) -> list[list[np.ndarray]]:
            perm = np.random.default_rng([seed, epoch]).permutation(self.total)
            return self._deal(perm)

        return order

    def mosaic(self, algo: str, nodes: int, seed: int) -> Order:
        """Mosaic Streaming's partition and shuffle (its defaults: canonical nodes = physical
        nodes for py1e/py1br, 64 x for py1s/py2s; block size max(4M / canonical, 2^18))."""
        from streaming.base.partition import get_partitions
        from streaming.base.shuffle import get_shuffle

        canonical = nodes * (64 if algo in {"py1s", "py2s"} else 1)
        block = max(4_000_000 // canonical, 1 << 18)
        sizes = np.array([self.samples] * self.shards, dtype=np.int64)

        def order(epoch: int) -> list[list[np.ndarray]]:
            ids = get_partitions(
                "orig", self.total, canonical, nodes, self.ranks // nodes, self.workers, self.batch
            )
            shuffle = get_shuffle(algo, sizes, canonical, seed, epoch, block)
            ids = np.where(ids != -1, shuffle[ids], -1)
            per_rank = ids.reshape(self.ranks, self.workers, -1)  # nodes x ranks, node-major
            return [[w[w != -1] for w in rank] for rank in per_rank]

        return order

    def _deal(self, perm: np.ndarray) -> list[list[np.ndarray]]:
        """``perm`` cut into per-consumer sequences so that the consumption order is ``perm``."""
        seqs: list[list[list[np.ndarray]]] = [
            [[] for _ in range(self.workers)] for _ in range(self.ranks)
        ]
        width = self.batch * self.ranks
        for step, start in enumerate(range(0, len(perm), width)):  # a global batch per step
            chunk = perm[start : start + width]
            for r in range(self.ranks):
                seqs[r][step % self.workers].append(chunk[r * self.batch : (r + 1) * self.batch])
        return [[np.concatenate(w) if w else np.array([], int) for w in rank] for rank in seqs]


def measure(ds: Dataset, order: Order, epochs: int) -> dict[str, float]:
    entropies, shards_per_batch, same = [], [], []
    previous: list[set[int]] | None = None
    for epoch in range(epochs):
        per_rank = order(epoch)
        glob = ds.global_order(per_rank)
        if len(np.unique(glob)) != ds.total:
            raise RuntimeError(f"epoch {epoch}: {len(np.unique(glob))} of {ds.total} samples")
        entropies.append(quality(glob, ds.shard_of))
        width = ds.batch * ds.ranks
        batches = [glob[i : i + width] for i in range(0, len(glob) - width + 1, width)]
        shards_per_batch.append(np.mean([len(np.unique(ds.shard_of[b])) for b in batches]))
        mine = [set(np.concatenate(rank).tolist()) for rank in per_rank]
        if previous is not None:
            same.append(np.mean([len(m & p) / len(m) for m, p in zip(mine, previous, strict=True)]))
        previous = mine
    return {
        "entropy_bits": round(float(np.mean(entropies)), 3),
        "shards_per_global_batch": round(float(np.mean(shards_per_batch)), 1),
        "same_rank_pct": round(100 * float(np.mean(same)), 1) if same else float("nan"),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    ds = Dataset(args.shards, args.samples, args.ranks, args.workers, args.batch)
    nodes = args.nodes
    rows: dict[str, Order] = {
        "no shuffle (shuffle_shards=False, no buffer)": ds.shardcache(
            per_node=None, buffer=0, shuffle=False, seed=args.seed
        ),
    }
    for buffer in args.buffers:
        rows[f"shardcache rank scope, shuffle_buffer={buffer}"] = ds.shardcache(
            per_node=None, buffer=buffer, shuffle=True, seed=args.seed
        )
    for buffer in args.buffers:
        rows[
            f"shardcache node scope ({nodes} nodes x {args.ranks // nodes} ranks), "
            f"shuffle_buffer={buffer}"
        ] = ds.shardcache(per_node=args.ranks // nodes, buffer=buffer, shuffle=True, seed=args.seed)
    for buffer in args.buffers:
        rows[
            f'shardcache shuffle_scope="global", node scope ({nodes} nodes x '
            f"{args.ranks // nodes} ranks), shuffle_buffer={buffer}"
        ] = ds.shardcache(
            per_node=args.ranks // nodes,
            buffer=buffer,
            shuffle=True,
            seed=args.seed,
            scope="global",
        )
    try:
        from bench.support import peers

        peers.require_mosaic()
        for algo in ("py1e", "py1s"):
            default = " (its default)" if algo == "py1e" else ""
            rows[f"Mosaic Streaming {algo}{default}, {nodes} nodes"] = ds.mosaic(
                algo, nodes, args.seed
            )
    except Exception as exc:  # not installed: the table says so
        rows_note = f"Mosaic Streaming not measured ({type(exc).__name__}: {exc})"
    else:
        rows_note = ""
    rows["global shuffle (uniform permutation)"] = ds.global_shuffle(args.seed)
    results = {name: measure(ds, order, args.epochs) for name, order in rows.items()}
    low = results["no shuffle (shuffle_shards=False, no buffer)"]["entropy_bits"]
    high = results["global shuffle (uniform permutation)"]["entropy_bits"]
    for res in results.values():
        res["of_global"] = round((res["entropy_bits"] - low) / (high - low), 3)
    return {
        "setup": vars(args) | {"samples_total": ds.total},
        "results": results,
        "note": rows_note,
    }


def table(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [
        f"{s['shards']} shards x {s['samples']} samples, {s['ranks']} ranks x {s['workers']} "
        f"workers, batch {s['batch']} per rank, mean over epochs 0..{s['epochs'] - 1}",
        "",
        "| order | entropy (bits) | of the way to global | shards per global batch | "
        "a rank's samples it had the epoch before |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['entropy_bits']:.2f} | {100 * r['of_global']:.0f} % | "
            f"{r['shards_per_global_batch']:g} | {r['same_rank_pct']:g} % |"
        )
    if report["note"]:
        lines += ["", report["note"]]
    return "\n".join(lines)


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=100, help="samples per shard")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=2, help="nodes, for node scope and Mosaic")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--buffers", type=int, nargs="+", default=[0, 1000])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    return table_main(main_parser(), run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
