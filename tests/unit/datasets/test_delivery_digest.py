"""The delivery digest's algebra: order-independent, additive, a multiset (repeats count),
every single change seen; the vectorised hashing against a plain-Python reference."""

from __future__ import annotations

import random

import pytest
from delivery_reference import tally
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcache import ResumeError, SampleIndexError
from shardcache._datasets import delivery_digest
from shardcache._datasets.cache_shares import Run
from shardcache._datasets.delivery_digest import MASK, Recorder, SampleHasher, Tally

URLS = [f"s3://bucket/train-{i:06d}.tar" for i in range(5)]
STARTS = [[512 * 3 * k for k in range(40)] for _ in URLS]  # 40 samples a shard


def reference(epoch: int, source: str | None, samples: list[tuple[int, int]]) -> Tally:
    """The documented hash, one sample at a time with Python integers."""
    digest, count = tally(epoch, source, [(URLS[shard], index) for shard, index in samples])
    return Tally(int(digest, 16), count)


def samples_of(runs: list[Run]) -> list[tuple[int, int]]:
    return [(r.shard, i) for r in runs for i in range(r.first, r.stop)]


runs_lists = st.lists(
    st.builds(
        lambda shard, first, size: Run(shard, first, min(40, first + size)),
        st.integers(0, 4),
        st.integers(0, 39),
        st.integers(0, 12),
    ),
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(runs=runs_lists, epoch=st.integers(0, 5), source=st.sampled_from([None, "web"]))
def test_runs_hash_as_the_plain_reference(runs: list[Run], epoch: int, source) -> None:
    assert SampleHasher(URLS, epoch, source).runs(runs) == reference(
        epoch, source, samples_of(runs)
    )


@settings(max_examples=60, deadline=None)
@given(runs=runs_lists, seed=st.integers(0, 2**32))
def test_order_and_grouping_do_not_matter_and_tallies_add(runs: list[Run], seed: int) -> None:
    hasher = SampleHasher(URLS, 1, None)
    singles = [Run(s, i, i + 1) for s, i in samples_of(runs)]
    random.Random(seed).shuffle(singles)
    cut = len(singles) // 2
    whole = hasher.runs(runs)
    assert hasher.runs(singles) == whole
    assert hasher.runs(singles[:cut]) + hasher.runs(singles[cut:]) == whole
    assert whole - hasher.runs(singles[:cut]) == hasher.runs(singles[cut:])


def test_a_repeat_a_gap_or_a_swap_changes_the_tally() -> None:
    hasher = SampleHasher(URLS, 0, None)
    planned = hasher.runs([Run(0, 0, 10), Run(1, 0, 10)])
    repeated = hasher.runs([Run(0, 0, 10), Run(1, 0, 10), Run(1, 3, 4)])
    assert repeated == planned + hasher.runs([Run(1, 3, 4)]) and repeated.count == 21
    skipped = hasher.runs([Run(0, 0, 10), Run(1, 0, 3), Run(1, 4, 10)])
    assert skipped.count == 19 and skipped != planned
    # as many samples, one replaced by another: the count agrees, the digest does not
    swapped = hasher.runs([Run(0, 0, 10), Run(1, 0, 3), Run(1, 4, 11)])
    assert swapped.count == planned.count and swapped.digest != planned.digest
    # the same index of another shard, epoch or source is another sample
    assert hasher.runs([Run(2, 0, 10)]) != hasher.runs([Run(0, 0, 10)])
    assert SampleHasher(URLS, 1, None).runs([Run(0, 0, 10)]) != hasher.runs([Run(0, 0, 10)])
    assert SampleHasher(URLS, 0, "web").runs([Run(0, 0, 10)]) != hasher.runs([Run(0, 0, 10)])


def test_every_single_change_of_a_plan_is_seen() -> None:
    """Over a plan of 200 samples: each one left out, and each replaced by each other
    sample of its shard, gives another tally."""
    hasher = SampleHasher(URLS, 3, "code")
    plan = [(s, i) for s in range(5) for i in range(40)]
    full = hasher.runs([Run(s, i, i + 1) for s, i in plan])
    for drop in range(len(plan)):
        rest = plan[:drop] + plan[drop + 1 :]
        assert hasher.runs([Run(s, i, i + 1) for s, i in rest]) != full
    for shard in range(5):
        for index in range(40):
            one = hasher.runs([Run(shard, index, index + 1)])
            for other in range(40):
                if other != index:
                    changed = full - one + hasher.runs([Run(shard, other, other + 1)])
                    assert changed != full


def test_long_runs_are_hashed_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [Run(0, 0, 40), Run(3, 5, 33), Run(1, 0, 1)]
    expected = reference(0, None, samples_of(runs))
    monkeypatch.setattr(delivery_digest, "_CHUNK", 7)
    assert SampleHasher(URLS, 0, None).runs(runs) == expected


@settings(max_examples=40, deadline=None)
@given(runs=runs_lists, seed=st.integers(0, 2**32), every=st.integers(1, 9))
def test_the_recorder_folds_positions_as_the_runs_hash(runs, seed: int, every: int) -> None:
    order = samples_of(runs)
    random.Random(seed).shuffle(order)
    recorder = Recorder(SampleHasher(URLS, 2, None), STARTS)
    record = recorder.positions.append  # as the reading loop holds it
    taken = Tally()
    for n, (shard, index) in enumerate(order):
        record((shard, STARTS[shard][index], f"key{index}"))
        if n % every == every - 1:
            recorder.fold()
        if n % 7 == 6:
            taken += recorder.take()
    taken += recorder.take()
    assert taken == reference(2, None, order)
    assert recorder.take() == Tally()


def test_a_position_the_index_does_not_list_is_refused() -> None:
    recorder = Recorder(SampleHasher(URLS, 0, None), STARTS)
    recorder.positions.append((1, 100, "k"))  # not a sample's first byte
    with pytest.raises(SampleIndexError, match=r"train-000001\.tar") as caught:
        recorder.take()
    assert caught.value.seen == 100


def test_the_json_form_round_trips_and_a_damaged_one_is_refused() -> None:
    tally = Tally(0xFEDCBA9876543210, 12)
    assert tally.as_json() == ["fedcba9876543210", 12]
    assert Tally.from_json(tally.as_json()) == tally
    assert str(tally) == "12 samples (digest fedcba9876543210)"
    for bad in (None, "x", ["zz", 3], ["01"], 5):
        with pytest.raises(ResumeError, match="damaged"):
            Tally.from_json(bad)
    assert (Tally(MASK, 1) + Tally(2, 1)) == Tally(1, 2)
    assert (Tally(1, 1) - Tally(2, 1)) == Tally(MASK, 0)
