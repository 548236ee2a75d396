"""Which cache owns which samples: whole shards handed out by count so that a change in
the number of caches moves as few shards as it can, then evened out to equal sample counts.

*Whole shards, by count, nested by cache count.* The hand-out needs nothing read: each
cache learns the sample offsets of its own whole shards only (one read of each shard
across the job, :mod:`shardcache._datasets.job_index`), and the real counts are then used
to even out. With one cache, it holds every shard (in the order given). The hand-out for
``k + 1`` caches is the one for ``k`` plus a new cache, which takes whole shards, one at a
time, each from the end of the list of the cache that holds most shards, until it holds
about ``S / (k + 1)`` of the ``S`` shards. Only the new cache receives, so going from
``U`` to ``U + 1`` caches moves only the shards the new cache takes (about
``1 / (U + 1)`` of them, the least any balanced hand-out can move), and going from ``U``
to ``U - 1`` only the last cache's shards (about ``1 / U``); old caches keep everything
else. Every cache holds ``floor(S / U)`` or ``ceil(S / U)`` shards.

*Equal samples.* Each cache's quota is ``floor(T / U)`` or ``ceil(T / U)`` of the ``T``
samples (the fuller caches get the larger ones). A cache above its quota gives the samples
past it, from the end of its list (a shard it keeps the start of is then read by two
caches); the caches below theirs take those samples in cache order. Shards of about equal
sample counts (what ``webdataset.ShardWriter(maxcount=...)`` writes; within 10 %) leave
every cache within about one shard of its quota: the job reads at most ``caches`` shards
besides each cache's own. Shards of very unequal counts cost more (counts spread from 40
to 157: about 2.5 shards of others per cache). These hand-overs, unlike the whole shards,
are redrawn when the cache count changes: from ``U`` to ``U + 1`` caches every old cache
must hand on about ``T / (U (U + 1))`` samples anyway, here each to a cache that did not
read that shard, so about one shard per cache is fetched again besides the new cache's
own (passing them along shards two caches already share could save some; not done).

Everything here is a pure function of its arguments: every rank computes the same.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """Samples ``first`` .. ``stop - 1`` of shard ``shard`` (indices in the shard)."""

    shard: int
    first: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.first


def cache_shares(shards: Sequence[int], counts: Sequence[int], caches: int) -> list[list[Run]]:
    """The samples each of ``caches`` owns: ``shards`` (indices, in a stable order) handed
    out whole by count, nested by cache count, then evened out with their sample
    ``counts`` (by shard index) to ``floor``/``ceil`` of the mean."""
    held = whole_runs(shards, counts, caches)
    loads = [_samples(runs) for runs in held]
    return even_out(held, quotas(sum(loads), loads))


def whole_runs(shards: Sequence[int], counts: Sequence[int], caches: int) -> list[list[Run]]:
    """Each cache's whole shards (:func:`whole_shards`) as runs of their ``counts`` samples;
    shards without samples left out."""
    return [
        [Run(s, 0, counts[s]) for s in mine if counts[s]] for mine in whole_shards(shards, caches)
    ]


def quotas(total: int, loads: Sequence[int]) -> list[int]:
    """``total`` split into ``len(loads)`` equal parts (to one sample); the larger parts go
    to the largest ``loads`` (ties: the lower index), which moves the fewest samples."""
    each, extra = divmod(total, len(loads))
    larger = sorted(range(len(loads)), key=lambda u: (-loads[u], u))[:extra]
    parts = [each] * len(loads)
    for unit in larger:
        parts[unit] += 1
    return parts


def even_out(held: Sequence[Sequence[Run]], parts: Sequence[int]) -> list[list[Run]]:
    """``held`` with every list cut or filled to ``parts``: lists over their part give the
    runs past it (from their end), lists under it take those, in list order."""
    kept: list[list[Run]] = []
    given: list[Run] = []
    for runs, part in zip(held, parts, strict=True):
        keep, give = _cut(runs, part)
        kept.append(keep)
        given += give
    offered = iter(given)
    spare: Run | None = None
    for keep, part in zip(kept, parts, strict=True):
        need = part - _samples(keep)
        while need > 0:
            run = spare if spare is not None else next(offered)
            spare = None
            if len(run) > need:
                run, spare = (
                    Run(run.shard, run.first, run.first + need),
                    Run(run.shard, run.first + need, run.stop),
                )
            keep.append(run)
            need -= len(run)
    return kept


def owners(shares: Sequence[Sequence[Run]], shard_count: int) -> list[int]:
    """For every shard, the share holding most of its samples (ties: the first; -1: none)."""
    best = [(0, -1)] * shard_count
    for unit, runs in enumerate(shares):
        for run in runs:
            if len(run) > best[run.shard][0]:
                best[run.shard] = (len(run), unit)
    return [unit for _, unit in best]


def whole_shards(shards: Sequence[int], caches: int) -> list[list[int]]:
    """``shards`` handed out whole to ``caches`` by count, nested: the hand-out for
    ``k + 1`` caches is the one for ``k`` with some shards moved to the new cache, and only
    to it. Needs no sample count: what each cache indexes before any count is known."""
    total = len(shards)
    held = [list(shards)]
    fullest = [(-total, 0)]  # a heap of (-shards held, cache)
    for new in range(1, caches):
        mine: list[int] = []
        while held[fullest[0][1]]:
            donor = fullest[0][1]
            if (new + 1) * (2 * len(mine) + 1) >= 2 * total:  # no nearer S/(new+1) with it
                break
            mine.append(held[donor].pop())
            heapq.heapreplace(fullest, (-len(held[donor]), donor))
        held.append(mine)
        heapq.heappush(fullest, (-len(mine), new))
    return held


def _cut(runs: Sequence[Run], count: int) -> tuple[list[Run], list[Run]]:
    """The first ``count`` samples of ``runs``, and the rest."""
    keep: list[Run] = []
    for index, run in enumerate(runs):
        if count <= 0:
            return keep, list(runs[index:])
        if len(run) > count:
            cut = run.first + count
            return [*keep, Run(run.shard, run.first, cut)], [
                Run(run.shard, cut, run.stop),
                *runs[index + 1 :],
            ]
        keep.append(run)
        count -= len(run)
    return keep, []


def _samples(runs: Sequence[Run]) -> int:
    return sum(len(run) for run in runs)
