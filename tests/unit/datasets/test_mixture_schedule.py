"""Mixture schedules over local shards: weights that change per epoch and in steps within
an epoch, sources joining and leaving (weight 0), exact and elastic resume across a
change, and the refusal of a state taken with another schedule.

Property tests draw sources (2-3, a few shards of random sizes), a schedule of 3 epochs
(each the sources' weights or 1-3 steps at random samples, a weight 0 now and then), the
epoch size, seed, ``remainder``, shuffle buffer, ranks x workers, batch and window sizes
and stop points. Consumer ``r*W + w`` of R ranks x W workers is built as ``rank=r*W+w,
world_size=R*W`` (as test_mixture_properties.py does). Checked in every epoch: every
consumer the same total; in every step each source's count differing by at most one
between consumers and, when the consumers divide the epoch, exactly the step's counts;
each window of ``N`` global batches within ``6 * R * min(N, W)`` samples of what the steps
in force ask (a window's samples each counted at its step's proportions); a consumer's
state (and the job's) taken anywhere in an epoch before a change resumes exactly and then
reads the changed epoch as the uninterrupted run; the job's state onto another consumer
count delivers every undelivered sample and then the new layout's fresh changed epoch.
"""

from __future__ import annotations

import json
import math
import pickle
import tempfile
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mixture_files import MixtureFiles, Pair, global_batches, pairs, schedule_entries
from tars import shard_samples, tar_bytes
from torchdata.stateful_dataloader import StatefulDataLoader

from shardcache import ConfigError, MixtureDataset, ResumeError, ShardCache, Source, Step, job_state
from shardcache._datasets.epoch_split import consumer_counts

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LAYOUTS = [(r, w) for r in (1, 2, 3) for w in (1, 2)]  # ranks x workers


@st.composite
def scheduled(draw: st.DrawFn) -> dict:
    ranks, workers = draw(st.sampled_from(LAYOUTS))
    other = draw(st.sampled_from([(r, w) for r, w in LAYOUTS if r * w != ranks * workers]))
    most = max(ranks * workers, other[0] * other[1])
    k = draw(st.integers(2, 3))
    shards = [draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)) for _ in range(k)]
    epoch_size = draw(st.integers(most, 40))
    entries = draw(schedule_entries(k, epoch_size, 3))
    return {
        "shards": shards,
        "schedule": entries,
        "epoch_size": epoch_size,
        "layout": (ranks, workers),
        "other": other,
        "seed": draw(st.integers(0, 2**32)),
        "remainder": draw(st.sampled_from(["pad", "drop"])),
        "buffer": draw(st.sampled_from([0, 0, 3])),
        "shuffle_shards": draw(st.booleans()),
        "batch": draw(st.integers(1, 5)),
        "window": draw(st.integers(1, 4)),
        "epoch": draw(st.integers(0, 1)),  # the state's; the next epoch's weights may differ
        "fractions": draw(st.lists(st.floats(0, 1), min_size=6, max_size=6)),
    }


class Mix:
    """Shard files for one example (keys unique across sources) and mixtures over them."""

    def __init__(self, root: Path, spec: dict) -> None:
        self.spec = spec
        files = MixtureFiles(root, spec["shards"])
        self.cache, self.keys = files.cache, files.keys
        self.sources = [
            Source(urls, name=name, index=index, weight=1) for name, urls, index in files.parts
        ]

    def dataset(
        self, slot: int, consumers: int, epoch: int | None = None, schedule=None
    ) -> MixtureDataset:
        dataset = MixtureDataset(
            self.sources,
            epoch_size=self.spec["epoch_size"],
            seed=self.spec["seed"],
            shuffle_shards=self.spec["shuffle_shards"],
            shuffle_buffer=self.spec["buffer"],
            remainder=self.spec["remainder"],
            cache=self.cache,
            threads=1,
            rank=slot,
            world_size=consumers,
            schedule=self.spec["schedule"] if schedule is None else schedule,
        )
        dataset.set_epoch(self.spec["epoch"] if epoch is None else epoch)
        return dataset

    def run(self, consumers: int, epoch: int | None = None) -> list[list[Pair]]:
        return [pairs(self.dataset(c, consumers, epoch)) for c in range(consumers)]

    def steps(self, epoch: int) -> list[tuple[int, ...]]:
        """Each step's counts of every source, from the schedule as given."""
        entry = self.spec["schedule"][min(epoch, 2)]
        steps = [Step(0, entry)] if isinstance(entry, dict) else entry
        ends = [s.at for s in steps[1:]] + [self.spec["epoch_size"]]
        out = []
        for step, end in zip(steps, ends, strict=True):
            weights = [step.weights[f"m{i}"] for i in range(len(self.sources))]
            exact = [Fraction((end - step.at) * w, sum(weights)) for w in weights]
            counts = [math.floor(x) for x in exact]
            by_rest = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
            for i in by_rest[: end - step.at - sum(counts)]:
                counts[i] += 1
            out.append(tuple(counts))
        return out


def tagged_batches(runs: list[list[Pair]], ranks: int, workers: int, batch: int) -> list[list]:
    """The global batches, each item (consumer, position in its stream, pair)."""
    tagged = [[(slot, t, p) for t, p in enumerate(run)] for slot, run in enumerate(runs)]
    return global_batches(tagged, ranks, workers, batch)


def largest_remainders(weights: list[int], count: int) -> list[int]:
    if not any(weights):  # nothing to split by: the last step
        return [0] * (len(weights) - 1) + [count]
    exact = [Fraction(count * w, sum(weights)) for w in weights]
    counts = [math.floor(x) for x in exact]
    by_rest = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_rest[: count - sum(counts)]:
        counts[i] += 1
    return counts


def step_positions(mix: Mix, epoch: int, consumers: int) -> list[list[int]]:
    """Each consumer's step of each place in its stream (by consumer_counts, whose
    properties test_epoch_split.py checks)."""
    n, flat = len(mix.sources), [c for step in mix.steps(epoch) for c in step]
    laid = consumer_counts(flat, consumers, mix.spec["remainder"], 1)
    out = []
    for slot in range(consumers):
        sizes = [sum(laid[k + i][slot] for i in range(n)) for k in range(0, len(laid), n)]
        out.append([k for k, size in enumerate(sizes) for _ in range(size)])
    return out


def check_elastic_steps(mix: Mix, runs, taken, rests) -> None:
    """Every resumed consumer mixes its leftover step by step: its count of a source in
    each step that source's leftover split as the job's leftover of it is (largest
    remainders), the steps one after another."""
    names = [f"m{i}" for i in range(len(mix.sources))]
    places = step_positions(mix, mix.spec["epoch"], len(runs))
    left = [[0] * len(names) for _ in mix.steps(mix.spec["epoch"])]
    for slot, run in enumerate(runs):
        for t in range(taken[slot], len(run)):
            left[places[slot][t]][names.index(run[t][0])] += 1
    for rest in rests:
        own = Counter(s for s, _ in rest)
        columns = [
            largest_remainders([row[i] for row in left], own[n]) for i, n in enumerate(names)
        ]
        at = 0
        for row in zip(*columns, strict=True):
            got = Counter(s for s, _ in rest[at : at + sum(row)])
            assert [got[n] for n in names] == list(row), (row, got)
            at += sum(row)


def check_epoch(mix: Mix, epoch: int, runs: list[list[Pair]]) -> None:
    """The steps of ``epoch`` in the consumers' streams, and every window's proportions."""
    consumers, names = len(runs), [f"m{i}" for i in range(len(mix.sources))]
    assert len({len(run) for run in runs}) == 1  # the same total each
    asked = mix.steps(epoch)
    flat = [c for step in asked for c in step]
    ranks, workers = (
        mix.spec["layout"] if consumers == math.prod(mix.spec["layout"]) else (mix.spec["other"])
    )
    laid = consumer_counts(flat, consumers, mix.spec["remainder"], 1)
    step_of: list[list[int]] = []  # each consumer's step of each of its samples
    job = [[0] * len(names) for _ in asked]
    for slot, run in enumerate(runs):
        sizes = [
            sum(laid[k * len(names) + i][slot] for i in range(len(names)))
            for k in range(len(asked))
        ]
        assert sum(sizes) == len(run)
        step_of.append([k for k, size in enumerate(sizes) for _ in range(size)])
        per_step = [Counter() for _ in asked]
        for k, (source, key) in zip(step_of[slot], run, strict=True):
            per_step[k][source] += 1
            assert key in mix.keys[source]
        for k in range(len(asked)):
            for i, name in enumerate(names):
                assert per_step[k][name] == laid[k * len(names) + i][slot], (slot, k, name)
                job[k][i] += per_step[k][name]
    for k, step in enumerate(asked):  # each source's count a step within one between consumers
        for i in range(len(names)):
            got = [laid[k * len(names) + i][slot] for slot in range(consumers)]
            assert max(got) - min(got) <= 1
        if mix.spec["epoch_size"] % consumers == 0:  # exactly the step's counts asked
            assert tuple(job[k]) == step
    window, bound = mix.spec["window"], 6 * ranks * min(mix.spec["window"], workers)
    batches = tagged_batches(runs, ranks, workers, mix.spec["batch"])
    for start in range(max(1, len(batches) - window + 1)):
        inside = [item for batch in batches[start : start + window] for item in batch]
        got = Counter(pair[0] for _, _, pair in inside)
        for i, name in enumerate(names):  # each sample at its step's proportion of the source
            expected = sum(
                Fraction(job[step_of[slot][t]][i], sum(job[step_of[slot][t]]))
                for slot, t, _ in inside
            )
            assert abs(got[name] - expected) < bound, (start, name, got[name], expected)


@SETTINGS
@given(scheduled())
def test_every_epoch_and_window_follows_the_schedule_in_force(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        mix = Mix(Path(root), spec)
        consumers = math.prod(spec["layout"])
        for epoch in range(3):
            runs = mix.run(consumers, epoch)
            check_epoch(mix, epoch, runs)
            for name, keys in mix.keys.items():  # asked no more than it holds: none twice
                got = Counter(key for run in runs for source, key in run if source == name)
                if got.total() <= len(keys):
                    assert max(got.values(), default=1) == 1, (epoch, name, got)


@SETTINGS
@given(scheduled())
def test_a_state_before_a_change_resumes_exactly_then_follows_the_schedule(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        mix = Mix(Path(root), spec)
        consumers = math.prod(spec["layout"])
        runs = mix.run(consumers)
        nexts = mix.run(consumers, spec["epoch"] + 1)
        states, taken = [], []
        for slot in range(consumers):
            k = round(spec["fractions"][slot] * len(runs[slot]))
            dataset = mix.dataset(slot, consumers)
            iterator = iter(dataset)
            assert pairs(next(iterator) for _ in range(k)) == runs[slot][:k]
            states.append(json.loads(json.dumps(dataset.state_dict())))
            iterator.close()
            taken.append(k)
        whole = job_state(states)
        for slot in range(consumers):
            for state in (states[slot], whole):
                dataset = mix.dataset(slot, consumers)
                dataset.load_state_dict(state)
                assert pairs(dataset) == runs[slot][taken[slot] :]
                dataset.set_epoch(spec["epoch"] + 1)  # the next epoch, changed or not
                assert pairs(dataset) == nexts[slot]

        # Elastic: every undelivered sample of each source, then the new layout's next epoch.
        resumed_with = math.prod(spec["other"])
        delivered = Counter(p for slot, run in enumerate(runs) for p in run[: taken[slot]])
        left = Counter(p for run in runs for p in run) - delivered
        resumed = [mix.dataset(slot, resumed_with) for slot in range(resumed_with)]
        for dataset in resumed:
            dataset.load_state_dict(whole)
        rests = [pairs(dataset) for dataset in resumed]
        assert len({len(rest) for rest in rests}) == 1
        got = Counter(p for rest in rests for p in rest)
        if spec["remainder"] == "pad":  # all that was left, the rest repeats of it
            assert not left - got and set(got) == set(left)
        else:
            assert not got - left
        check_elastic_steps(mix, runs, taken, rests)

        # The elastically resumed epoch's own states (midway, through JSON) resume exactly.
        again, stops = [], []
        for slot in range(resumed_with):
            k = len(rests[slot]) // 2
            dataset = mix.dataset(slot, resumed_with)
            dataset.load_state_dict(whole)
            iterator = iter(dataset)
            assert pairs(next(iterator) for _ in range(k)) == rests[slot][:k]
            again.append(json.loads(json.dumps(dataset.state_dict())))
            iterator.close()
            stops.append(k)
        for slot in range(resumed_with):
            for state in (again[slot], job_state(again)):
                dataset = mix.dataset(slot, resumed_with)
                dataset.load_state_dict(state)
                assert pairs(dataset) == rests[slot][stops[slot] :]
        for dataset in resumed:
            dataset.set_epoch(spec["epoch"] + 1)
        after = [pairs(dataset) for dataset in resumed]
        assert after == mix.run(resumed_with, spec["epoch"] + 1)
        check_epoch(mix, spec["epoch"] + 1, after)


# -- examples ---------------------------------------------------------------------------

SIZES = {"web": (12, 9, 15), "code": (6, 5), "books": (4, 6)}


@pytest.fixture
def urls(tmp_path: Path) -> dict[str, list[str]]:
    out, shard = {}, 0
    for name, counts in SIZES.items():
        out[name] = []
        for count in counts:
            path = tmp_path / f"{name}-{shard:04d}.tar"
            path.write_bytes(tar_bytes(shard_samples(shard, count, size=8)))
            out[name].append(str(path))
            shard += 1
    return out


def anneal(epoch: int) -> list[Step]:
    """Epoch 0: web and code; from epoch 1 books joins; its last 10 % (from sample 54)
    anneals to books (module level: spawned DataLoader workers unpickle it)."""
    if epoch == 0:
        return [Step(0, {"books": 0})]
    return [Step(0, {}), Step(54, {"web": 1, "code": 0, "books": 5})]


def mixture(tmp_path: Path, urls: dict, schedule, rank: int = 0, world: int = 1, **options):
    return MixtureDataset(
        [Source(urls[n], weight=w, name=n) for n, w in (("web", 3), ("code", 2), ("books", 1))],
        epoch_size=options.pop("epoch_size", 60),
        seed=4,
        cache=ShardCache(tmp_path / "cache"),
        threads=1,
        rank=rank,
        world_size=world,
        schedule=schedule,
        **options,
    )


def test_a_function_schedule_anneals_the_end_of_the_epoch_and_a_source_joins(
    tmp_path: Path, urls
) -> None:
    """60 samples over 2 consumers: epoch 0 web 36 / code 24 / books 0; epoch 1 from
    sample 54 on (3 a consumer) 1 web and 5 books a 6, before it 27 / 18 / 9."""
    counts = {}
    for epoch in (0, 1):
        runs = []
        for rank in (0, 1):
            dataset = mixture(tmp_path, urls, anneal, rank, 2)
            dataset.set_epoch(epoch)
            runs.append(pairs(dataset))
        counts[epoch] = Counter(s for run in runs for s, _ in run)
        if epoch == 1:
            assert [Counter(s for s, _ in run[27:]) for run in runs] == [
                Counter(web=1, books=2),
                Counter(books=3),
            ]
            assert Counter(s for run in runs for s, _ in run[:27]) == Counter(
                web=27, code=18, books=9
            )
    assert counts == {0: Counter(web=36, code=24), 1: Counter(web=28, code=18, books=14)}


def test_workers_follow_a_function_schedule_and_resume_across_its_change(
    tmp_path: Path, urls
) -> None:
    """Through a StatefulDataLoader of 2 workers, prepared: 16 batches an epoch, epoch 0
    and 1 of the schedule's counts; a loader state taken in epoch 0 (before the change)
    resumes epoch 0 and then reads the changed epoch 1 as the uninterrupted run. The
    mixture pickled (as spawned workers receive it) reads epoch 1 as the forked ones."""

    def loader_of(dataset: MixtureDataset) -> StatefulDataLoader:
        return StatefulDataLoader(
            dataset, batch_size=4, num_workers=2, collate_fn=pairs, timeout=60
        )

    dataset = mixture(tmp_path, urls, anneal).prepare(workers=2)
    loader = loader_of(dataset)
    reference, state = [], None
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        for step, batch in enumerate(loader):
            reference.append(batch)
            if (epoch, step) == (0, 3):
                state = json.loads(json.dumps(loader.state_dict()))
    assert len(reference) == 32  # 30 a worker an epoch: 8 batches each
    assert Counter(s for b in reference[:16] for s, _ in b) == Counter(web=36, code=24)
    assert Counter(s for b in reference[16:] for s, _ in b) == Counter(web=28, code=18, books=14)

    again = mixture(tmp_path, urls, anneal).prepare(workers=2)
    loader = loader_of(again)
    loader.load_state_dict(state)
    got = []
    for epoch in (0, 1):
        again.set_epoch(epoch)
        got += list(loader)
    assert reference[:4] + got == reference

    unpickled = pickle.loads(pickle.dumps(again))
    alone = mixture(tmp_path, urls, anneal)
    alone.set_epoch(1)
    assert pairs(unpickled) == pairs(alone)


def test_a_state_after_a_change_resumes_after_it_and_a_changed_schedule_is_refused(
    tmp_path: Path, urls
) -> None:
    """A state in the annealed step of epoch 1 resumes there; the same schedule with
    another epoch 1 is refused naming the epoch, the step and the source with both
    weights; one that differs only in later epochs resumes."""
    dataset = mixture(tmp_path, urls, anneal)
    dataset.set_epoch(1)
    whole = pairs(dataset)
    dataset = mixture(tmp_path, urls, anneal)
    dataset.set_epoch(1)
    iterator = iter(dataset)
    assert pairs(next(iterator) for _ in range(56)) == whole[:56]  # 2 into the last step
    state = json.loads(json.dumps(dataset.state_dict()))
    iterator.close()
    assert state["schedule"]["steps"][1]["weights"] == {"web": 1, "code": 0, "books": 5}

    resumed = mixture(tmp_path, urls, anneal)
    resumed.load_state_dict(state)
    assert pairs(resumed) == whole[56:]

    def hotter(epoch: int) -> list[Step]:
        steps = anneal(epoch)
        return [steps[0], Step(54, {"web": 1, "code": 0, "books": 9})] if epoch == 1 else steps

    with pytest.raises(
        ResumeError, match=r"epoch 1, step 1: source 'books' weight 5 in the state, 9"
    ) as e:
        mixture(tmp_path, urls, hotter).load_state_dict(state)
    assert (e.value.epoch, e.value.step, e.value.source) == (1, 1, "books")
    with pytest.raises(
        ResumeError, match=r"epoch 1, step 1 starts at sample 54 in the state, None in this"
    ):
        mixture(tmp_path, urls, [anneal(0), [Step(0, {})]]).load_state_dict(state)
    with pytest.raises(
        ResumeError, match=r"epoch 1, step 1 starts at sample 54 in the state, 48 in this"
    ):
        mixture(
            tmp_path, urls, [anneal(0), [Step(0, {}), Step(48, anneal(1)[1].weights)]]
        ).load_state_dict(state)

    changed_later = [anneal(0), anneal(1), {"web": 1, "code": 1, "books": 1}]
    resumed = mixture(tmp_path, urls, changed_later)
    resumed.load_state_dict(state)
    assert pairs(resumed) == whole[56:]
    resumed.set_epoch(2)
    assert Counter(s for s, _ in pairs(resumed)) == Counter(web=20, code=20, books=20)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], "schedule is an empty list"),
        ({"web": 1}, "schedule must be a list of entries"),
        ([{"news": 1}], r"names \['news'\], not a source of this mixture"),
        (
            [{"web": -1}],
            "epoch 0's schedule, source 'web': weight must be a finite number >= 0, not -1",
        ),
        ([{"web": 0, "code": 0, "books": 0}], "every source weight 0 from sample 0"),
        ([[Step(5, {})]], r"start at samples \[5\]: the first must start at 0"),
        ([[Step(0, {}), Step(0, {})]], "each later one after the one before"),
        ([[Step(0, {}), Step(60, {})]], "a step at sample 60, not within the epoch's 60"),
        ([{"web": 1}, "web"], "epoch 1's schedule entry must be the sources' weights"),
    ],
)
def test_a_bad_schedule_is_a_config_error(tmp_path: Path, urls, schedule, message) -> None:
    with pytest.raises(ConfigError, match=message):
        mixture(tmp_path, urls, schedule)


def test_a_schedule_needs_weights_and_an_epoch_size(tmp_path: Path, urls) -> None:
    with pytest.raises(ConfigError, match="source 'b' has samples= but the mixture has a sch"):
        MixtureDataset(
            [Source(urls["web"], weight=1, name="a"), Source(urls["code"], samples=3, name="b")],
            epoch_size=10,
            schedule=[{"a": 1}],
        )
    with pytest.raises(ConfigError, match="a mixture with a schedule needs epoch_size"):
        MixtureDataset([Source(urls["web"], weight=1)], schedule=[{}])
