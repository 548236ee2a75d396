"""A mixture source walks on through its samples across epochs whatever its schedule
asks of it: each cache's window of an epoch starts where that cache's reads of the
epochs before left it (the schedule's counts summed), so no sample comes again before
every other came as often.

Property tests over the pure split (sources of a few shards of random sizes, schedules of
1-4 entries of weights or steps, 0 weights included, epoch sizes, seeds, ``remainder``,
caches x consumers a cache, 6 epochs), each source's epochs split as the mixture does (one
split re-laid each epoch), checked after every epoch with ``T`` samples of a source of
``S`` delivered so far:

- one cache: every sample ``floor(T / S)`` or ``ceil(T / S)`` times, for any schedule
  (down- or up-sampled); an epoch computed alone (a restarted job) deals what the epoch
  computed after the ones before does;
- several caches: while no epoch asks a cache for more of the source than it holds
  (``ceil(d / U) <= floor(S / U)`` for an epoch's ``d`` samples of it), each cache's
  samples within one of each other, and the whole source within two with none more than
  ``ceil(T / S) + 1`` times when each cache holds more than ``2 (E + ceil(T / S))``.

And through MixtureDataset: a one-consumer job whose weights change every epoch delivers
each source's samples evenly over epochs, and a mixture state of version 3 is refused.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mixture_files import MixtureFiles, pairs, schedule_entries
from split_samples import delivered, starts_of

from shardcache import MixtureDataset, ResumeError, Source
from shardcache._datasets.epoch_split import EpochSplit, Lay
from shardcache._datasets.mixture_schedule import MixtureSchedule

EPOCHS = 6
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def walks(draw: st.DrawFn, units: st.SearchStrategy[int], most: int) -> dict:
    k = draw(st.integers(2, 3))
    unit_count, per_unit = draw(units), draw(st.integers(1, 3))
    consumers = unit_count * per_unit
    shards = [draw(st.lists(st.integers(1, most), min_size=1, max_size=3)) for _ in range(k)]
    epoch_size = draw(st.integers(max(consumers, 2), 4 * most))
    entries = draw(schedule_entries(k, epoch_size, draw(st.integers(1, 4))))
    return {
        "shards": shards,
        "entries": entries,
        "epoch_size": epoch_size,
        "units": unit_count,
        "per_unit": per_unit,
        "remainder": draw(st.sampled_from(["pad", "drop"])),
        "seed": draw(st.integers(0, 2**32)),
        "shuffle": draw(st.booleans()),
    }


def epochs_of(spec: dict, index: int):
    """Each epoch of source ``index``: its split (re-laid, as the mixture's) and every
    consumer's samples."""
    k = len(spec["shards"])
    names = [f"m{i}" for i in range(k)]
    schedule = MixtureSchedule(
        names, [1] * k, [1] * k, (spec["epoch_size"], spec["remainder"]), spec["entries"]
    )
    starts = starts_of(spec["shards"][index])
    options = {"seed": spec["seed"], "shuffle": spec["shuffle"], "remainder": spec["remainder"]}
    split = EpochSplit(starts, lay=Lay(schedule.lay(0), index, k, schedule.lay), **options)
    consumers = spec["units"] * spec["per_unit"]
    for epoch in range(EPOCHS):
        lay = Lay(schedule.lay(epoch), index, k, schedule.lay)
        split = split.relaid(lay)
        shares = [split.fresh(epoch, consumers, spec["per_unit"], c) for c in range(consumers)]
        alone = EpochSplit(starts, lay=lay, **options)  # a job started at this epoch
        assert [alone.fresh(epoch, consumers, spec["per_unit"], c) for c in range(consumers)] == (
            shares
        )
        yield split, [delivered(split, share.pieces) for share in shares]


@SETTINGS
@given(walks(st.just(1), 9))
def test_one_cache_delivers_every_sample_once_before_any_again_for_any_schedule(
    spec: dict,
) -> None:
    for index, counts in enumerate(spec["shards"]):
        total, seen = sum(counts), Counter()
        for epoch, (_, runs) in enumerate(epochs_of(spec, index)):
            for run in runs:
                seen.update(run)
            every = [seen[(s, i)] for s, n in enumerate(counts) for i in range(n)]
            delivered = seen.total()
            assert max(every) <= -(-delivered // total), (epoch, index, every)
            assert min(every) >= delivered // total, (epoch, index, every)


@SETTINGS
@given(walks(st.integers(2, 3), 40))
def test_each_cache_walks_its_own_samples_and_the_source_stays_within_two(spec: dict) -> None:
    units, per_unit = spec["units"], spec["per_unit"]
    for index, counts in enumerate(spec["shards"]):
        total, seen = sum(counts), Counter()
        least = total // units  # what each cache holds at least
        for epoch, (split, runs) in enumerate(epochs_of(spec, index)):
            asked = sum(len(run) for run in runs)
            if -(-asked // units) > least:
                break  # a cache asked for more than it holds: its holdings follow the lay
            holdings = split.unit_shares(units, per_unit)
            for slot, run in enumerate(runs):  # each consumer reads its cache's samples
                seen.update(run)
                held = {
                    (r.shard, i) for r in holdings[slot // per_unit] for i in range(r.first, r.stop)
                }
                assert set(run) <= held or not held
            for mine in holdings:
                own = [seen[(r.shard, i)] for r in mine for i in range(r.first, r.stop)]
                assert not own or max(own) - min(own) <= 1, (epoch, index, own)
            every = [seen[(s, i)] for s, n in enumerate(counts) for i in range(n)]
            laps = -(-seen.total() // total)
            if least > 2 * (epoch + 1 + laps):
                assert max(every) - min(every) <= 2 and max(every) <= laps + 1, every


# -- through MixtureDataset -------------------------------------------------------------


def changing(epoch: int) -> dict[str, float]:
    """Every epoch other weights: m0 asked 7, 11, 3, 13, 5, 9 of its 20 samples."""
    return {"m0": [7, 11, 3, 13, 5, 9][epoch % 6], "m1": 20 - [7, 11, 3, 13, 5, 9][epoch % 6]}


@pytest.fixture
def files(tmp_path: Path) -> MixtureFiles:
    return MixtureFiles(tmp_path, [[8, 5, 7], [9, 12, 6]])


def mixture(files: MixtureFiles, schedule=changing) -> MixtureDataset:
    return MixtureDataset(
        [Source(urls, name=name, index=index, weight=1) for name, urls, index in files.parts],
        epoch_size=20,
        seed=3,
        cache=files.cache,
        threads=1,
        rank=0,
        world_size=1,
        schedule=schedule,
    )


def test_a_source_whose_count_changes_every_epoch_walks_on_through_its_samples(
    files: MixtureFiles,
) -> None:
    """m0 (20 samples) is asked 7, 11, 3, 13, 5, 9 over six epochs (48 in all): after
    each epoch every sample of it came floor or ceil of what was delivered / 20 times;
    m1 (27 samples) likewise. A job restarted at epoch 3 reads it as the one that ran."""
    dataset = mixture(files)
    seen: Counter = Counter()
    runs = []
    for epoch in range(6):
        dataset.set_epoch(epoch)
        runs.append(pairs(dataset))
        seen.update(runs[-1])
        for name, keys in files.keys.items():
            got = [seen[(name, key)] for key in keys]
            delivered = sum(got)
            assert max(got) <= -(-delivered // len(keys)), (epoch, name, sorted(got))
            assert min(got) >= delivered // len(keys), (epoch, name, sorted(got))
    restarted = mixture(files)
    restarted.set_epoch(3)
    assert pairs(restarted) == runs[3]


def test_a_mixture_state_of_version_3_is_refused_saying_what_to_do(files: MixtureFiles) -> None:
    dataset = mixture(files)
    state = json.loads(json.dumps(dataset.state_dict()))
    state["version"] = 3
    with pytest.raises(ResumeError, match=r"version 3 .* reads version 4.*start the epoch again"):
        mixture(files).load_state_dict(state)


def test_a_stepped_epoch_the_consumers_do_not_divide_repeats_no_sample_of_a_source_asked_all():
    """Two steps of two sources (4 + 9, then 1 + 10: 24 samples) over 3 caches of 3
    consumers: the pad (3 samples) goes to the second source, asked 19 + 3 = 22 of its 22:
    every cache holds what its 3 consumers read of it (the holdings count the pad as the
    consumers spread it, not as 3 caches alone would), so each sample comes once."""
    split = EpochSplit(
        starts_of([7, 7, 8]),
        seed=1,
        shuffle=False,
        remainder="pad",
        lay=Lay((4, 9, 1, 10), 1, 2),
    )
    seen = Counter(
        s for slot in range(9) for s in delivered(split, split.fresh(1, 9, 3, slot).pieces)
    )
    assert seen.total() == 22 and set(seen.values()) == {1}


def test_a_state_whose_earlier_epochs_asked_otherwise_is_refused_naming_the_source(
    files: MixtureFiles,
) -> None:
    """A state of epoch 2 resumes with the schedule it was taken with, and with one that
    differs only after epoch 2; one whose epoch 0 asked m0 for 8, not 7 (its walk would
    start elsewhere), is refused naming the source and both totals (7 + 11 = 18 and 19)."""
    dataset = mixture(files)
    dataset.set_epoch(2)
    whole = pairs(dataset)
    dataset = mixture(files)
    dataset.set_epoch(2)
    iterator = iter(dataset)
    assert pairs(next(iterator) for _ in range(5)) == whole[:5]
    state = json.loads(json.dumps(dataset.state_dict()))
    iterator.close()
    later = [changing(0), changing(1), changing(2), {"m0": 1, "m1": 1}]
    for schedule in (changing, later):
        resumed = mixture(files, schedule=schedule)
        resumed.load_state_dict(state)
        assert pairs(resumed) == whole[5:]
    earlier = [{"m0": 8, "m1": 12}, changing(1), changing(2)]
    with pytest.raises(
        ResumeError, match=r"epochs before its epoch 2 \(source 'm0' samples 18 in the state, 19"
    ) as e:
        mixture(files, schedule=earlier).load_state_dict(state)
    assert (e.value.epoch, e.value.source) == (2, "m0")
