"""Shards that move between caches when a job resumes onto another node (or rank) count.

    python -m bench.studies.elastic_moves [--seed 0] [--json FILE]

For each case (shards, caches before -> after), the shards are given random sample counts
(40 to 157, as the DDP tests' shards), and ``EpochSplit.shard_units`` (what the dataset and
``warm --split dataset`` use) says which shards each cache reads in every epoch before and
after. Caches keep their index (node ``i`` stays node ``i``; new ones start empty, removed
ones are gone). *Moved* counts the shards a cache reads after the change and did not
before: what the caches must download again. Two references:

* *at least*: ``shards * |after - before| / max(before, after)``, the share of the data the
  added caches must receive or the removed ones held (exact for equal shards);
* *contiguous spans*: cache ``u`` of ``U`` owning the samples ``[u*T/U, (u+1)*T/U)`` of the
  same seeded order, the hand-out this library used before (every span after a change
  shifts).
"""

from __future__ import annotations

import argparse
import bisect
import random
import sys
from itertools import accumulate
from typing import Any

from bench.support.infra import table_main
from shardcache._datasets.epoch_split import EpochSplit

CASES = [
    (2000, 8, 7),
    (2000, 8, 9),
    (2000, 16, 12),
    (20000, 100, 99),
    (20000, 100, 101),
    (20000, 100, 50),
    (20000, 100, 200),
    (100000, 1000, 999),
    (100000, 1000, 1001),
    (100000, 8000, 8008),
]


def contiguous(split: EpochSplit, caches: int) -> list[set[int]]:
    """The shards of each contiguous span of the split's seeded order."""
    order = [run.shard for run in split.unit_shares(1)[0]]
    ends = list(accumulate(split.counts[shard] for shard in order))
    total = ends[-1]
    owned: list[set[int]] = []
    for unit in range(caches):
        first, last = unit * total // caches, (unit + 1) * total // caches
        begin, stop = bisect.bisect_right(ends, first), bisect.bisect_left(ends, last)
        owned.append(set(order[begin : stop + 1]) if last > first else set())
    return owned


def moved(before: list[set[int]], after: list[set[int]]) -> int:
    return sum(
        len(shards - (before[u] if u < len(before) else set())) for u, shards in enumerate(after)
    )


def case(shards: int, before: int, after: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    counts = [rng.randint(40, 157) for _ in range(shards)]
    split = EpochSplit([range(count) for count in counts], seed=seed, shuffle=True, remainder="pad")
    layout = {caches: [set(s) for s in split.shard_units(caches)] for caches in (before, after)}
    spans = {caches: contiguous(split, caches) for caches in (before, after)}
    return {
        "shards": shards,
        "before": before,
        "after": after,
        "moved": moved(layout[before], layout[after]),
        "at_least": round(shards * abs(after - before) / max(before, after)),
        "contiguous": moved(spans[before], spans[after]),
        "reads_per_shard": sum(map(len, layout[after])) / shards,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = [c for c in CASES if c[0] <= args.max_shards]
    return [case(shards, before, after, args.seed) for shards, before, after in cases]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| shards | caches | moved | at least | contiguous spans | reads per shard after |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        pct = {k: f"{row[k]:,} ({100 * row[k] / row['shards']:.1f} %)" for k in _FIGURES}
        lines.append(
            f"| {row['shards']:,} | {row['before']} -> {row['after']} | {pct['moved']} | "
            f"{pct['at_least']} | {pct['contiguous']} | {row['reads_per_shard']:.3f} |"
        )
    return "\n".join(lines)


_FIGURES = ("moved", "at_least", "contiguous")


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shards", type=int, default=100000, help="skip larger cases")
    return parser


def main(argv: list[str] | None = None) -> int:
    return table_main(main_parser(), run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
