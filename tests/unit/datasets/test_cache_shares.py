"""Which cache owns which samples (pure functions): every sample owned once, equal to one
sample, another cache count moving few shards, and the hand-out that needs no count
costing about one shard of another cache each."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache._datasets.cache_shares import Run, cache_shares, even_out, owners, whole_shards


def shares_of(counts: list[int], caches: int) -> list[list[Run]]:
    return cache_shares(range(len(counts)), counts, caches)


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
    shares = shares_of(counts, caches)
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
    before = [set(s) for s in whole_shards(range(len(counts)), caches)]
    after = [set(s) for s in whole_shards(range(len(counts)), caches + 1)]
    for unit in range(caches):
        assert after[unit] <= before[unit]
    assert after[caches] == set().union(*before) - set().union(*after[:caches])


def test_one_cache_more_or_less_moves_about_its_share_of_the_shards() -> None:
    rng = random.Random(7)
    counts = [rng.randint(40, 157) for _ in range(2000)]
    at = {caches: shard_sets(shares_of(counts, caches)) for caches in (10, 19, 20, 21, 40)}
    # The least a change can move: the new cache's shards, or the removed cache's, plus
    # the evening out redrawn (counts this unequal: about 2.5 shards of others a cache).
    assert moved(at[20], at[21]) <= len(at[21][20]) + 3 * 21
    assert moved(at[20], at[19]) <= len(at[20][19]) + 3 * 20
    # Half the caches more or fewer: about half the shards, as little as possible.
    assert moved(at[20], at[40]) <= 1000 + 2 * 40
    assert moved(at[20], at[10]) <= 1000 + 2 * 20
    # Contiguous spans (the hand-out before this one) moved about 50 % for one cache more.
    assert moved(at[20], at[21]) < 2000 * 0.1


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 40))
def test_whole_shards_by_count_differ_by_at_most_one_shard(shards: int, caches: int) -> None:
    held = whole_shards(range(shards), caches)
    assert sorted(s for mine in held for s in mine) == list(range(shards))
    assert {len(mine) for mine in held} <= {shards // caches, -(-shards // caches)}


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 120).flatmap(
        lambda shards: st.lists(st.integers(90, 110), min_size=shards, max_size=shards)
    ),
    st.integers(1, 16),
)
def test_shards_of_about_equal_counts_cost_each_cache_at_most_one_other_shard(
    counts: list[int], caches: int
) -> None:
    """What learning the index costs the job: each cache reads its own whole shards (the
    count hand-out) and, evening out, parts of others: with counts within 10 % of each
    other, fewer than one besides its own per cache (so the job reads at most shards +
    caches)."""
    own = [set(s) for s in whole_shards(range(len(counts)), caches)]
    extra = [
        len(read - mine)
        for read, mine in zip(shard_sets(shares_of(counts, caches)), own, strict=True)
    ]
    assert sum(extra) <= caches, extra


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
