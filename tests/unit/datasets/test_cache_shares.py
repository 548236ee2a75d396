"""Which cache owns which samples (pure functions): every sample owned once, equal to one
sample, and another cache count moving few shards."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache._datasets.cache_shares import Run, cache_shares, even_out, owners, whole_shards


def shard_runs(counts: list[int]) -> list[Run]:
    return [Run(shard, 0, count) for shard, count in enumerate(counts) if count]


def shard_sets(shares: list[list[Run]]) -> list[set[int]]:
    return [{run.shard for run in runs} for runs in shares]


def moved(before: list[set[int]], after: list[set[int]]) -> int:
    """Shards a cache reads after the change but did not before (caches keep their index;
    a new cache had nothing)."""
    return sum(
        len(shards - (before[u] if u < len(before) else set())) for u, shards in enumerate(after)
    )


counts_strategy = st.lists(st.integers(0, 60), min_size=1, max_size=40).filter(any)


@settings(max_examples=200, deadline=None)
@given(counts_strategy, st.integers(1, 12))
def test_every_sample_is_owned_once_and_shares_differ_by_at_most_one(
    counts: list[int], caches: int
) -> None:
    shares = cache_shares(shard_runs(counts), caches)
    assert len(shares) == caches
    owned = Counter((run.shard, i) for runs in shares for run in runs for i in range(*_span(run)))
    assert set(owned.values()) == {1}
    assert set(owned) == {(s, i) for s, n in enumerate(counts) for i in range(n)}
    loads = [sum(len(run) for run in runs) for runs in shares]
    assert max(loads) - min(loads) <= 1


@settings(max_examples=200, deadline=None)
@given(counts_strategy, st.integers(1, 12))
def test_whole_shards_are_nested_by_cache_count(counts: list[int], caches: int) -> None:
    """From ``k`` to ``k + 1`` caches only the new cache receives: every old cache keeps a
    part of what it had and the new one holds only shards the others gave up."""
    before = shard_sets(whole_shards(shard_runs(counts), caches))
    after = shard_sets(whole_shards(shard_runs(counts), caches + 1))
    for unit in range(caches):
        assert after[unit] <= before[unit]
    assert after[caches] == set().union(*before) - set().union(*after[:caches])


def test_one_cache_more_or_less_moves_about_its_share_of_the_shards() -> None:
    rng = random.Random(7)
    runs = shard_runs([rng.randint(40, 157) for _ in range(2000)])
    at = {caches: shard_sets(cache_shares(runs, caches)) for caches in (10, 19, 20, 21, 40)}
    # The least a change can move: the new cache's shards, or the removed cache's.
    assert moved(at[20], at[21]) <= len(at[21][20]) + 21
    assert moved(at[20], at[19]) <= len(at[20][19]) + 20
    # Half the caches more or fewer: about half the shards, as little as possible.
    assert moved(at[20], at[40]) <= 1000 + 40
    assert moved(at[20], at[10]) <= 1000 + 20
    # Contiguous spans (the hand-out before this one) moved about 50 % for one cache more.
    assert moved(at[20], at[21]) < 2000 * 0.1


def test_evening_out_hands_the_surplus_from_the_end_to_the_caches_short_of_theirs() -> None:
    held = [[Run(0, 0, 10), Run(1, 0, 6)], [Run(2, 0, 3)], [Run(3, 0, 5)]]
    assert even_out(held, [8, 7, 9]) == [
        [Run(0, 0, 8)],
        [Run(2, 0, 3), Run(0, 8, 10), Run(1, 0, 2)],
        [Run(3, 0, 5), Run(1, 2, 6)],
    ]


def test_owners_name_the_share_holding_most_of_a_shard() -> None:
    shares = [[Run(0, 0, 3)], [Run(0, 3, 10), Run(1, 0, 2)], []]
    assert owners(shares, 3) == [1, 1, -1]


def _span(run: Run) -> tuple[int, int]:
    return run.first, run.stop
