"""The epoch split with ``scope="global"`` (``shuffle_scope="global"``, pure functions):
every epoch deals the shards across the whole job anew, each sample once an epoch (pad and
drop as in the cache-local split), equal shares, the same deal on every rank, epoch 0's
deal the cache-local hand-out, and an elastic resume's leftover dealt completely."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from split_samples import delivered, starts_of

from shardcache import ConfigError
from shardcache._datasets.epoch_split import EpochSplit, Lay, consumer_counts, scope_rule


def _split(counts: list[int], seed: int = 3, **options) -> EpochSplit:
    options = {"shuffle": True, "remainder": "pad", "scope": "global", **options}
    return EpochSplit(starts_of(counts), seed=seed, **options)


def _unit_shards(split: EpochSplit, epoch: int, units: int, per_unit: int) -> list[set[int]]:
    """The shards each unit's consumers read in ``epoch``."""
    consumers = units * per_unit
    return [
        {
            shard
            for slot in range(unit * per_unit, (unit + 1) * per_unit)
            for shard, _ in delivered(split, split.fresh(epoch, consumers, per_unit, slot).pieces)
        }
        for unit in range(units)
    ]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=14),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from(["pad", "drop"]),
    st.integers(0, 2**32),
    st.integers(0, 6),
)
def test_every_epochs_deal_gives_each_sample_once_and_every_consumer_the_same(
    counts: list[int], units: int, per_unit: int, remainder: str, seed: int, epoch: int
) -> None:
    if sum(counts) == 0:
        counts[0] = 1
    split = _split(counts, seed, remainder=remainder)
    consumers = units * per_unit
    if remainder == "drop" and sum(counts) < consumers:
        return  # refused, as in the cache-local split
    sizes = split.totals(consumers, per_unit)
    seen: Counter[tuple[int, int]] = Counter()
    for slot in range(consumers):
        share = split.fresh(epoch, consumers, per_unit, slot)
        samples = delivered(split, share.pieces)
        assert len(samples) == share.samples == sizes["per_consumer"]
        seen.update(samples)
    every = {(shard, i) for shard, n in enumerate(counts) for i in range(n)}
    assert set(seen) <= every
    assert len(every - set(seen)) == sizes["dropped"]
    assert sum(seen.values()) - len(seen) == sizes["repeated"]
    if sizes["repeated"] == 0:
        assert max(seen.values()) == 1


def test_the_deal_changes_every_epoch_and_epoch_0_is_the_cache_local_hand_out() -> None:
    counts, units, per_unit = [20] * 64, 4, 2
    split, local = _split(counts), _split(counts, scope="cache")
    deals = [_unit_shards(split, epoch, units, per_unit) for epoch in range(6)]
    assert deals[0] == _unit_shards(local, 0, units, per_unit)  # home: what each cache indexed
    assert all(_unit_shards(local, e, units, per_unit) == deals[0] for e in range(1, 3))
    for before, after in itertools.pairwise(deals):
        assert before != after
        stayed = sum(len(b & a) for b, a in zip(before, after, strict=True))
        assert stayed < 64 * 0.45  # about a quarter stay on their unit with 4 units
    for deal in deals:  # balanced: whole shards of equal counts, 16 a unit
        assert sorted(len(shards) for shards in deal) == [16] * units
        assert set().union(*deal) == set(range(64))


def test_the_deal_is_the_same_whatever_was_computed_before() -> None:
    """Every rank computes the same deal on its own: a fresh split, or one that computed
    other epochs and layouts first, gives the same shares."""
    counts = [7, 13, 9, 11, 12, 5, 8, 10, 14, 6]
    first, second = _split(counts), _split(counts)
    for epoch in (5, 1, 9, 2):
        second.fresh(epoch, 6, 3, 4)
        second.fresh(epoch, 4, 1, 0)
    for epoch in range(1, 5):
        for slot in range(6):
            assert first.fresh(epoch, 6, 2, slot) == second.fresh(epoch, 6, 2, slot)
    assert _split(counts, seed=4).fresh(3, 6, 2, 0) != first.fresh(3, 6, 2, 0)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 20), min_size=2, max_size=12),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.data(),
)
def test_an_elastic_resume_deals_the_leftover_of_the_epoch_completely(
    counts: list[int], per_unit: int, units: int, new_units: int, data: st.DataObject
) -> None:
    split, epoch = _split(counts), data.draw(st.integers(0, 4))
    consumers = units * per_unit
    left = []
    for slot in range(consumers):
        pieces = split.fresh(epoch, consumers, per_unit, slot).pieces
        left += pieces[data.draw(st.integers(0, len(pieces))) :]
    wanted = Counter(s for piece in left for s in delivered(split, [piece]))
    got: Counter[tuple[int, int]] = Counter()
    shares = [
        split.share(left, new_units * per_unit, per_unit, slot, epoch)
        for slot in range(new_units * per_unit)
    ]
    for share in shares:
        got.update(delivered(split, share.pieces))
    assert len({share.samples for share in shares}) == 1
    assert set(got) == set(wanted) and all(got[s] >= wanted[s] for s in wanted)


def test_a_scope_is_checked() -> None:
    assert scope_rule("global", True) == "global"
    with pytest.raises(ConfigError, match="shuffle_scope must be one of"):
        scope_rule("node", True)
    with pytest.raises(ConfigError, match="'global' with shuffle_shards=True only"):
        _split([3, 4], shuffle=False)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=8), min_size=2, max_size=3),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from(["pad", "drop"]),
    st.data(),
)
def test_a_mixtures_sources_dealt_anew_give_their_counts_and_none_twice_an_epoch(
    sources: list[list[int]], units: int, per_unit: int, remainder: str, data: st.DataObject
) -> None:
    """A ``MixtureDataset`` with ``shuffle_scope="global"``: each source's split (its samples
    walking on over epochs, as a mixture's do) deals every consumer its count of the source
    each epoch; an epoch asking no more than the source holds repeats none."""
    consumers = units * per_unit
    sources = [counts if sum(counts) else [1, *counts[1:]] for counts in sources]
    asked = tuple(data.draw(st.integers(0, sum(counts))) for counts in sources)
    if sum(asked) < consumers:
        return
    want = consumer_counts(asked, consumers, remainder, per_unit)
    for index, counts in enumerate(sources):
        lay = Lay(asked, index, history=lambda _epoch: asked)
        split = _split(counts, 7, remainder=remainder, epoch_size=asked[index] or None, lay=lay)
        for epoch in range(3):
            seen: Counter[tuple[int, int]] = Counter()
            for slot in range(consumers):
                share = split.fresh(epoch, consumers, per_unit, slot)
                samples = delivered(split, share.pieces)
                assert len(samples) == share.samples == want[index][slot]
                seen.update(samples)
            if seen.total() <= sum(counts):
                assert not seen or max(seen.values()) == 1, (index, epoch)
