"""The sample-level epoch split (pure functions): equal shares, exact repeats and drops,
the same shards for each cache in every epoch, and the elastic split of a leftover."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from split_samples import delivered, starts_of

from shardcache import ConfigError, SampleIndexError
from shardcache._datasets.epoch_split import (
    RELAID_KEPT,
    EpochSplit,
    Lay,
    consumer_counts,
    indexing_shares,
)
from shardcache._datasets.resume_plan import Piece


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    shards = draw(st.integers(1, 12))
    counts = draw(st.lists(st.integers(0, 30), min_size=shards, max_size=shards))
    if sum(counts) == 0:
        counts[0] = draw(st.integers(1, 5))
    per_unit = draw(st.integers(1, 4))
    return {
        "counts": counts,
        "per_unit": per_unit,
        "consumers": per_unit * draw(st.integers(1, 5)),
        "seed": draw(st.integers(0, 2**32)),
        "shuffle": draw(st.booleans()),
    }


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from(["pad", "drop"]), st.integers(0, 5))
def test_every_consumer_gets_the_same_number_and_the_rest_is_exactly_the_reported(
    job: dict, remainder: str, epoch: int
) -> None:
    split = EpochSplit(
        starts_of(job["counts"]), seed=job["seed"], shuffle=job["shuffle"], remainder=remainder
    )
    consumers, total = job["consumers"], sum(job["counts"])
    if remainder == "drop" and total < consumers:
        with pytest.raises(ConfigError, match="every sample would be dropped"):
            split.totals(consumers)
        return
    sizes = split.totals(consumers)
    seen: Counter[tuple[int, int]] = Counter()
    repeats = 0
    for slot in range(consumers):
        share = split.fresh(epoch, consumers, job["per_unit"], slot)
        samples = delivered(split, share.pieces)
        assert len(samples) == share.samples == sizes["per_consumer"]
        seen.update(samples)
        repeats += share.repeated
    every = {(s, i) for s, n in enumerate(job["counts"]) for i in range(n)}
    assert set(seen) <= every
    assert sum(seen.values()) == consumers * sizes["per_consumer"]
    if remainder == "pad":
        assert set(seen) == every  # nothing lost
        assert sum(seen.values()) - len(every) == sizes["repeated"] == repeats
        assert sizes["dropped"] == 0
    else:
        assert max(seen.values()) == 1  # nothing repeated
        assert len(every) - len(seen) == sizes["dropped"]
        assert sizes["repeated"] == repeats == 0


@settings(max_examples=100, deadline=None)
@given(layouts(), st.sampled_from(["pad", "drop"]))
def test_each_cache_reads_the_same_shards_in_every_epoch(job: dict, remainder: str) -> None:
    split = EpochSplit(
        starts_of(job["counts"]), seed=job["seed"], shuffle=job["shuffle"], remainder=remainder
    )
    consumers, per_unit = job["consumers"], job["per_unit"]
    if remainder == "drop" and sum(job["counts"]) < consumers:
        return
    owned = split.shard_units(consumers // per_unit)
    for epoch in range(4):
        for unit in range(consumers // per_unit):
            read = set()
            for k in range(per_unit):
                share = split.fresh(epoch, consumers, per_unit, unit * per_unit + k)
                read |= {p.shard for p in share.pieces}
            assert read <= set(owned[unit])


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 60).flatmap(
        lambda shards: st.lists(st.integers(90, 110), min_size=shards, max_size=shards)
    ),
    st.integers(1, 10),
    st.integers(0, 2**32),
    st.booleans(),
)
def test_each_cache_indexes_shards_it_reads_and_the_job_reads_at_most_one_more_a_cache(
    counts: list[int], units: int, seed: int, shuffle: bool
) -> None:
    """What learning the index costs: the shards each cache indexes before any count is
    known (``indexing_shares``, from the shard count alone) are one each across the job,
    and the split made once the counts are known reads at most ``units`` shards more."""
    indexed = indexing_shares(len(counts), seed, shuffle, units)
    assert sorted(s for mine in indexed for s in mine) == list(range(len(counts)))
    split = EpochSplit(starts_of(counts), seed=seed, shuffle=shuffle, remainder="pad")
    read = split.shard_units(units)
    besides = sum(len(set(r) - set(mine)) for r, mine in zip(read, indexed, strict=True))
    assert besides <= units


def test_the_order_within_a_cache_changes_with_the_epoch() -> None:
    split = EpochSplit(starts_of([10] * 16), seed=3, shuffle=True, remainder="pad")
    orders = {tuple(p.shard for p in split.fresh(epoch, 2, 1, 0).pieces) for epoch in range(5)}
    assert len(orders) > 1
    assert {frozenset(order) for order in orders} == {frozenset(split.shard_units(2)[0])}


def test_a_shard_evened_out_between_two_caches_is_read_by_both() -> None:
    split = EpochSplit(starts_of([5, 5, 5]), seed=0, shuffle=False, remainder="pad")
    # 15 samples over 2 caches: the second takes shard 2 whole (taking shard 1 too would
    # bring it no nearer 7.5); the first, at 10, keeps 8 (the fuller gets the odd sample)
    # and hands samples 3 and 4 of shard 1 to the second, so both read shard 1.
    assert split.shard_units(2) == [[0, 1], [1, 2]]
    first = delivered(split, split.fresh(0, 2, 1, 0).pieces)
    second = delivered(split, split.fresh(0, 2, 1, 1).pieces)
    assert first == [(0, i) for i in range(5)] + [(1, 0), (1, 1), (1, 2)]
    # 8 each: the second owns 7 and repeats the first of its epoch order.
    assert second == [(2, i) for i in range(5)] + [(1, 3), (1, 4), (2, 0)]


def test_fewer_samples_than_consumers_pads_every_consumer() -> None:
    split = EpochSplit(starts_of([2, 1]), seed=0, shuffle=True, remainder="pad")
    sizes = split.totals(8)
    assert sizes == {
        "samples": 3,
        "epoch_size": 3,
        "per_consumer": 1,
        "repeated": 5,
        "dropped": 0,
    }
    shares = [split.fresh(0, 8, 2, slot) for slot in range(8)]
    assert all(share.samples == 1 for share in shares)
    assert sum(share.repeated for share in shares) == 5


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(1, 3), st.integers(1, 4), st.sampled_from(["pad", "drop"]), st.data())
def test_an_elastic_split_of_a_leftover_is_equal_and_complete(
    job: dict, per_unit: int, units: int, remainder: str, data: st.DataObject
) -> None:
    split = EpochSplit(
        starts_of(job["counts"]), seed=job["seed"], shuffle=job["shuffle"], remainder=remainder
    )
    # A leftover: some whole shards, a shard from a sample on, and single samples.
    left: list[Piece] = []
    for shard, count in enumerate(job["counts"]):
        if count == 0:
            continue
        start = data.draw(st.integers(0, count - 1))
        kind = data.draw(st.sampled_from(["rest", "single", "none"]))
        if kind == "rest":
            left.append(Piece(shard, 1024 * start))
        elif kind == "single":
            left.append(Piece(shard, 1024 * start, 1))
    expected = Counter(x for piece in left for x in delivered(split, [piece]))
    got: Counter[tuple[int, int]] = Counter()
    counts = set()
    consumers = per_unit * units
    for slot in range(consumers):
        share = split.share(left, consumers, per_unit, slot)
        samples = delivered(split, share.pieces)
        assert len(samples) == share.samples
        counts.add(share.samples)
        got.update(samples)
    assert len(counts) == 1
    if remainder == "pad":
        assert set(got) == set(expected)
    else:
        assert all(got[x] <= expected[x] for x in got)
        assert expected.total() - got.total() < consumers


def test_bad_input_is_named() -> None:
    with pytest.raises(SampleIndexError, match="hold no sample"):
        EpochSplit(starts_of([0, 0]), seed=0, shuffle=True, remainder="pad")
    with pytest.raises(ConfigError, match="remainder must be one of"):
        EpochSplit(starts_of([1]), seed=0, shuffle=True, remainder="wrap")
    split = EpochSplit(starts_of([3]), seed=0, shuffle=True, remainder="pad")
    with pytest.raises(SampleIndexError, match="no sample starting at byte 5"):
        split.run_of(Piece(0, 5))


def test_an_elastic_resume_hands_the_leftover_to_the_caches_owning_its_shards() -> None:
    rng = random.Random(1)
    counts = [rng.randint(40, 157) for _ in range(400)]
    split = EpochSplit(starts_of(counts), seed=5, shuffle=True, remainder="pad")
    for before, after in [(4, 3), (4, 5), (8, 6), (16, 17)]:
        left = []  # epoch 1 stopped with every consumer (2 a cache) at half its share
        for slot in range(before * 2):
            share = split.fresh(1, before * 2, 2, slot)
            done = share.samples // 2
            for piece in share.pieces:
                run = split.run_of(piece)
                if done < len(run):
                    left.append(Piece(piece.shard, 1024 * (run.first + done), len(run) - done))
                done = max(0, done - len(run))
        owned = split.shard_units(after)
        foreign = {
            (slot // 2, piece.shard)
            for slot in range(after * 2)
            for piece in split.share(left, after * 2, 2, slot).pieces
        } - {(unit, shard) for unit, shards in enumerate(owned) for shard in shards}
        # Only the evening out between caches reads shards outside the new layout's.
        assert len(foreign) <= 2 * after, (before, after, len(left), len(foreign))


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from(["pad", "drop"]), st.data())
def test_an_epoch_size_holds_on_every_consumer_and_later_epochs_deliver_the_rest(
    job: dict, remainder: str, data: st.DataObject
) -> None:
    total, consumers = sum(job["counts"]), job["consumers"]
    epoch_size = data.draw(st.integers(1, 3 * total + consumers))
    split = EpochSplit(
        starts_of(job["counts"]),
        seed=job["seed"],
        shuffle=job["shuffle"],
        remainder=remainder,
        epoch_size=epoch_size,
    )
    per_unit = job["per_unit"]
    if epoch_size < consumers:
        with pytest.raises(ConfigError, match=f"epoch_size={epoch_size} is smaller"):
            split.totals(consumers)
        return
    sizes = split.totals(consumers)
    each = sizes["per_consumer"]
    assert each == (-(-epoch_size // consumers) if remainder == "pad" else epoch_size // consumers)
    every = {(s, i) for s, n in enumerate(job["counts"]) for i in range(n)}
    seen_over_epochs: set[tuple[int, int]] = set()
    epochs = 1 + -(-total // (consumers * each))  # enough for every cache to cycle through
    for epoch in range(epochs):
        seen: Counter[tuple[int, int]] = Counter()
        for slot in range(consumers):
            share = split.fresh(epoch, consumers, per_unit, slot)
            samples = delivered(split, share.pieces)
            assert len(samples) == share.samples == each
            seen.update(samples)
        assert seen.total() == consumers * each
        if consumers * each <= total:  # no sample twice; the rest waits for later epochs
            assert max(seen.values()) == 1
            assert sizes["dropped"] == total - consumers * each and sizes["repeated"] == 0
        else:  # every sample, and exactly the reported repeats
            assert set(seen) == every
            assert seen.total() - total == sizes["repeated"] and sizes["dropped"] == 0
        seen_over_epochs |= set(seen)
    assert seen_over_epochs == every  # each cache cycled through all it owns


def test_an_epoch_size_is_part_of_the_bad_input_checks() -> None:
    split = EpochSplit(starts_of([5, 5]), seed=0, shuffle=True, remainder="pad", epoch_size=3)
    with pytest.raises(ConfigError, match="smaller than the job's 4 consumers"):
        split.fresh(0, 4, 2, 0)


# -- a mixture's sources split together -------------------------------------------------


def test_a_mixture_of_300_splits_150_90_60_between_4_consumers_exactly() -> None:
    assert consumer_counts([150, 90, 60], 4, "pad") == [
        [38, 38, 37, 37],
        [22, 22, 23, 23],  # laid on from where web's extra samples ended
        [15, 15, 15, 15],
    ]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=6),
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from(["pad", "drop"]),
)
def test_sources_split_together_give_every_consumer_the_same_total(
    counts: list[int], units: int, per_unit: int, remainder: str
) -> None:
    """The same total each; a source's counts differ by at most one between consumers and
    between caches; exactly the counts asked when the consumers divide the total, else
    only the total's remainder padded or dropped."""
    total, consumers = sum(counts), units * per_unit
    got = consumer_counts(counts, consumers, remainder, per_unit)
    for row in got:
        by_unit = [sum(row[u * per_unit : (u + 1) * per_unit]) for u in range(units)]
        assert max(by_unit) - min(by_unit) <= 1
    each = -(-total // consumers) if remainder == "pad" else total // consumers
    assert all(len(row) == consumers for row in got)
    assert {sum(row[j] for row in got) for j in range(consumers)} == {each}
    assert all(max(row) - min(row) <= 1 for row in got)
    job = [sum(row) for row in got]
    if total % consumers == 0:
        assert job == counts
    assert sum(abs(g - c) for g, c in zip(job, counts, strict=True)) == abs(
        each * consumers - total
    )
    assert all(
        (g >= c) if remainder == "pad" else (g <= c) for g, c in zip(job, counts, strict=True)
    )


@settings(max_examples=150, deadline=None)
@given(
    st.lists(layouts(), min_size=2, max_size=4),
    st.sampled_from(["pad", "drop"]),
    st.integers(0, 3),
    st.data(),
)
def test_each_source_of_a_lay_reads_its_consumers_counts_and_cycles_over_epochs(
    sources: list[dict], remainder: str, epoch: int, data: st.DataObject
) -> None:
    """Each source's split, given the mixture's counts, deals every consumer its count of
    that source (the same consumers and caches for every source); no more than the source
    holds: none twice in an epoch; more: every sample."""
    per_unit = sources[0]["per_unit"]
    consumers = sources[0]["consumers"]
    counts = tuple(data.draw(st.integers(0, 2 * sum(s["counts"]))) for s in sources)
    if sum(counts) < consumers:
        counts = (counts[0] + consumers - sum(counts), *counts[1:])
    want = consumer_counts(counts, consumers, remainder, per_unit)
    for index, job in enumerate(sources):
        split = EpochSplit(
            starts_of(job["counts"]),
            seed=job["seed"],
            shuffle=job["shuffle"],
            remainder=remainder,
            epoch_size=counts[index] or None,
            lay=Lay(counts, index),
        )
        seen: Counter[tuple[int, int]] = Counter()
        for slot in range(consumers):
            share = split.fresh(epoch, consumers, per_unit, slot)
            samples = delivered(split, share.pieces)
            assert len(samples) == share.samples == want[index][slot]
            seen.update(samples)
        if seen.total() <= sum(job["counts"]):
            assert not seen or max(seen.values()) == 1
        else:
            assert len(seen) == sum(job["counts"])
        assert split.totals(consumers, per_unit)["per_consumer"] == max(want[index])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(layouts(), min_size=2, max_size=3),
    st.integers(2, 3),
    st.sampled_from(["pad", "drop"]),
    st.data(),
)
def test_a_stepped_lay_deals_each_source_its_counts_over_the_steps_and_relays(
    sources: list[dict], steps: int, remainder: str, data: st.DataObject
) -> None:
    """A mixture epoch of several steps (``Lay.width`` sources a step): each source's split
    deals every consumer its counts summed over the steps; no more than the source holds
    (its pad included): none twice. A split re-laid
    (``relaid``) deals what a split made for that lay does; at most RELAID_KEPT + 1 kept."""
    per_unit, consumers = sources[0]["per_unit"], sources[0]["consumers"]
    n = len(sources)
    most = [sum(s["counts"]) // steps + 1 for s in sources]  # mostly down-sampled
    flat = [data.draw(st.integers(0, most[i])) for _ in range(steps) for i in range(n)]
    if sum(flat) < consumers:
        flat[0] += consumers - sum(flat)
    want = consumer_counts(flat, consumers, remainder, per_unit)
    for index, job in enumerate(sources):
        options = {"seed": job["seed"], "shuffle": job["shuffle"], "remainder": remainder}
        lay = Lay(tuple(flat), index, n)
        split = EpochSplit(starts_of(job["counts"]), lay=lay, **options)
        seen: Counter[tuple[int, int]] = Counter()
        for slot in range(consumers):
            share = split.fresh(1, consumers, per_unit, slot)
            samples = delivered(split, share.pieces)
            assert len(samples) == sum(want[k][slot] for k in range(index, len(flat), n))
            seen.update(samples)
        if seen.total() <= sum(job["counts"]):
            assert not seen or max(seen.values()) == 1
        other = EpochSplit(starts_of(job["counts"]), lay=Lay(tuple(flat[:n]), index), **options)
        relaid = other.relaid(lay)
        for slot in range(consumers):
            assert relaid.fresh(1, consumers, per_unit, slot) == split.fresh(
                1, consumers, per_unit, slot
            )
        for extra in range(RELAID_KEPT + 3):
            other.relaid(Lay((*flat[:-1], flat[-1] + extra + 1), index, n))
        assert len(other._relaid) <= RELAID_KEPT + 1
