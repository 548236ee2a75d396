"""Property-based tests of MixtureDataset over local shards: proportions per window of
global batches, equal shares, and exact and elastic resume.

Random sources (2-4, a few shards of random sizes, empty ones too), weights (ints, floats,
0) and ``samples=`` counts, epoch sizes, seeds, epochs, ``remainder``, shuffle buffers,
shard shuffling and ``shuffle_scope``, ranks (1-3) x workers (1-3), batch sizes, window
sizes and stop points.
Consumer ``r*W + w`` of a job of R ranks x W workers is built as ``rank=r*W+w,
world_size=R*W`` (as tests/unit/datasets/test_resume_properties.py does); a rank's
DataLoader takes its workers' batches in turn and a global batch is every rank's batch of
one step. Checked:

- every consumer gets the same total, each source's count differing by at most one between
  consumers (a source with fewer samples than consumers reaching only some); the epoch
  holds exactly each source's count when the consumers divide the mixture's total, else
  only the total's remainder is padded (``"pad"``) or dropped (``"drop"``); each sample of
  the right source, every prefix of a consumer's stream within Tijdeman's bound of its own
  counts, every rank the same number of batches, and in every window of ``N`` global
  batches each source less than ``3 * R * min(N, W)`` samples off the epoch's proportion
  (the bound of shardcache/_datasets/mixture.py's docstring);
- a consumer stopped anywhere resumes exactly from its own state and from the job's
  (through JSON), and its next epoch is the uninterrupted next epoch;
- the job's state resumed onto another consumer count delivers, per source, every
  undelivered sample (as a multiset), more only as the pad repeats of undelivered samples
  (``"drop"``: a subset), equal shares within the bounds, and the next epoch is the new
  layout's fresh one.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mixture_files import MixtureFiles, Pair, global_batches, pairs

from shardcache import MixtureDataset, Source, job_state

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LAYOUTS = [(r, w) for r in (1, 2, 3) for w in (1, 2, 3)]  # ranks x workers


@st.composite
def mixtures(draw: st.DrawFn) -> dict:
    ranks, workers = draw(st.sampled_from(LAYOUTS))
    other = draw(st.sampled_from([(r, w) for r, w in LAYOUTS if r * w != ranks * workers]))
    most = max(ranks * workers, other[0] * other[1])  # the mixture's total >= this
    k = draw(st.integers(2, 4))
    shards = [draw(st.lists(st.integers(0, 8), min_size=1, max_size=3)) for _ in range(k)]
    for counts in shards:
        counts[0] = max(counts[0], 1)
    kinds = draw(st.lists(st.sampled_from(["weight", "samples"]), min_size=k, max_size=k))
    amounts: list[float | int] = []
    for i, kind in enumerate(kinds):
        if kind == "samples":
            amounts.append(draw(st.integers(1, 30)))
        elif "weight" not in kinds[:i]:  # the first weight > 0, others maybe 0
            amounts.append(draw(st.integers(1, 3) | st.floats(0.5, 1.5)))
        else:
            amounts.append(draw(st.integers(0, 3) | st.floats(0.5, 1.5)))
    fixed = sum(a for a, kind in zip(amounts, kinds, strict=True) if kind == "samples")
    weights = [a for a, kind in zip(amounts, kinds, strict=True) if kind == "weight"]
    if weights:  # sources with fewer samples than consumers too
        epoch_size = max(most, fixed + draw(st.integers(0, 30)))
    else:
        if fixed < most:
            amounts[0] += most - fixed
        epoch_size = draw(st.sampled_from([None, max(fixed, most)]))
    return {
        "shards": shards,
        "kinds": kinds,
        "amounts": amounts,
        "epoch_size": epoch_size,
        "layout": (ranks, workers),
        "other": other,
        "seed": draw(st.integers(0, 2**32)),
        "epoch": draw(st.integers(0, 2)),
        "remainder": draw(st.sampled_from(["pad", "drop"])),
        "buffer": draw(st.sampled_from([0, 0, 2, 5])),
        "shuffle_shards": (shuffled := draw(st.booleans())),
        "shuffle_scope": draw(st.sampled_from(["cache", "global"])) if shuffled else "cache",
        "batch": draw(st.integers(1, 8)),
        "window": draw(st.integers(1, 6)),
        "fractions": draw(st.lists(st.floats(0, 1), min_size=9, max_size=9)),
    }


class Mix:
    """Shard files for one example (keys unique across sources) and mixtures over them."""

    def __init__(self, root: Path, spec: dict) -> None:
        self.spec = spec
        files = MixtureFiles(root, spec["shards"])
        self.cache, self.keys = files.cache, files.keys
        self.sources = [
            Source(urls, name=name, index=index, **{kind: amount})
            for (name, urls, index), kind, amount in zip(
                files.parts, spec["kinds"], spec["amounts"], strict=True
            )
        ]

    def dataset(self, slot: int, consumers: int, epoch: int | None = None) -> MixtureDataset:
        dataset = MixtureDataset(
            self.sources,
            epoch_size=self.spec["epoch_size"],
            seed=self.spec["seed"],
            shuffle_shards=self.spec["shuffle_shards"],
            shuffle_scope=self.spec["shuffle_scope"],
            shuffle_buffer=self.spec["buffer"],
            remainder=self.spec["remainder"],
            cache=self.cache,
            threads=1,
            rank=slot,
            world_size=consumers,
        )
        dataset.set_epoch(self.spec["epoch"] if epoch is None else epoch)
        return dataset

    def run(self, consumers: int, epoch: int | None = None) -> list[list[Pair]]:
        return [pairs(self.dataset(c, consumers, epoch)) for c in range(consumers)]

    def checkpoint(self, consumers: int, runs: list[list[Pair]]) -> tuple[list[dict], list[int]]:
        """Each consumer's state (through JSON) after a random part of its run, and how
        many samples each had delivered."""
        states, taken = [], []
        for slot in range(consumers):
            k = round(self.spec["fractions"][slot] * len(runs[slot]))
            dataset = self.dataset(slot, consumers)
            iterator = iter(dataset)
            assert pairs(next(iterator) for _ in range(k)) == runs[slot][:k]
            states.append(json.loads(json.dumps(dataset.state_dict())))
            iterator.close()
            taken.append(k)
        return states, taken

    def per_consumer(self, samples: int, consumers: int) -> int:
        if self.spec["remainder"] == "pad":
            return -(-samples // consumers)
        return samples // consumers


def check_epoch(
    mix: Mix,
    layout: tuple[int, int],
    names: list[str],
    runs: list[list[Pair]],
    asked: list[int] | None = None,
) -> None:
    """Consumers of ``layout`` (ranks, workers) reading ``names``: the same total each, a
    source's count differing by at most one between consumers, the ``asked`` counts of a
    fresh epoch exactly (only the total's remainder padded or dropped), each sample of its
    source, every consumer's prefixes within Tijdeman's bound of its own counts, every rank
    the same number of batches, and every window of global batches within
    ``3 * R * min(N, W)`` of the epoch's proportion."""
    own = [[Counter(s for s, _ in run)[name] for name in names] for run in runs]
    assert len({sum(counts) for counts in own}) == 1  # the same total each
    for i in range(len(names)):
        assert max(c[i] for c in own) - min(c[i] for c in own) <= 1
    job = [sum(c[i] for c in own) for i in range(len(names))]
    if asked is not None:
        consumers, total = len(runs), sum(asked)
        each = mix.per_consumer(total, consumers)
        assert sum(job) == consumers * each
        off = sum(abs(got - count) for got, count in zip(job, asked, strict=True))
        assert off == abs(consumers * each - total)  # only the total's remainder
        if mix.spec["remainder"] == "pad":
            assert all(got >= count for got, count in zip(job, asked, strict=True))
        else:
            assert all(got <= count for got, count in zip(job, asked, strict=True))
    for run, shares in zip(runs, own, strict=True):
        assert all(key in mix.keys[source] for source, key in run)
        total, live = sum(shares), sum(1 for share in shares if share)
        tijdeman = 1 - Fraction(1, 2 * live - 2) if live > 1 else Fraction(0)
        seen = Counter()
        for t, (source, _) in enumerate(run, 1):
            seen[source] += 1
            for name, share in zip(names, shares, strict=True):
                assert abs(seen[name] * total - t * share) <= tijdeman * total
    ranks, workers = layout
    total = sum(job)
    if not total:  # an elastic resume after every sample was delivered
        return
    batches = global_batches(runs, ranks, workers, mix.spec["batch"])
    window, bound = mix.spec["window"], 3 * ranks * min(mix.spec["window"], workers)
    for start in range(max(1, len(batches) - window + 1)):
        inside = Counter(s for batch in batches[start : start + window] for s, _ in batch)
        size = inside.total()
        for name, share in zip(names, job, strict=True):
            assert abs(inside[name] * total - size * share) < bound * total, (start, name)


@SETTINGS
@given(mixtures())
def test_every_window_of_global_batches_holds_each_source_near_its_proportion(
    spec: dict,
) -> None:
    with tempfile.TemporaryDirectory() as root:
        mix = Mix(Path(root), spec)
        consumers = math.prod(spec["layout"])
        first = mix.dataset(0, consumers)
        names, counts = first.names, first.counts
        runs = mix.run(consumers)
        check_epoch(mix, spec["layout"], names, runs, counts)
        for name in names:
            every = Counter(key for run in runs for s, key in run if s == name)
            if every.total() >= len(mix.keys[name]):  # all of it, the rest repeats
                assert set(every) == mix.keys[name]
            elif every:  # down-sampled: none twice
                assert max(every.values()) == 1


@SETTINGS
@given(mixtures())
def test_a_mixture_resumes_exactly_and_then_reads_the_uninterrupted_next_epoch(
    spec: dict,
) -> None:
    with tempfile.TemporaryDirectory() as root:
        mix = Mix(Path(root), spec)
        consumers = math.prod(spec["layout"])
        runs = mix.run(consumers)
        states, taken = mix.checkpoint(consumers, runs)
        whole = job_state(states)
        for slot in range(consumers):
            for state in (states[slot], whole):
                dataset = mix.dataset(slot, consumers)
                dataset.load_state_dict(state)
                assert pairs(dataset) == runs[slot][taken[slot] :]
        for slot in {0, consumers - 1}:
            dataset = mix.dataset(slot, consumers)
            dataset.load_state_dict(states[slot])
            list(dataset)
            dataset.set_epoch(spec["epoch"] + 1)
            assert pairs(dataset) == pairs(mix.dataset(slot, consumers, spec["epoch"] + 1))


@SETTINGS
@given(mixtures())
def test_another_layout_delivers_every_undelivered_sample_of_every_source(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        mix = Mix(Path(root), spec)
        consumers, resumed_with = math.prod(spec["layout"]), math.prod(spec["other"])
        runs = mix.run(consumers)
        states, taken = mix.checkpoint(consumers, runs)
        delivered = Counter(p for slot, run in enumerate(runs) for p in run[: taken[slot]])
        left = Counter(p for run in runs for p in run) - delivered
        gathered = job_state(states)
        resumed = [mix.dataset(slot, resumed_with) for slot in range(resumed_with)]
        for dataset in resumed:
            dataset.load_state_dict(gathered)
        rests = [pairs(dataset) for dataset in resumed]
        got = Counter(p for rest in rests for p in rest)
        names = resumed[0].names
        for name in names:
            left_of = Counter({p: n for p, n in left.items() if p[0] == name})
            got_of = Counter({p: n for p, n in got.items() if p[0] == name})
            each = mix.per_consumer(left_of.total(), resumed_with)
            assert all(Counter(s for s, _ in rest)[name] == each for rest in rests), name
            assert got_of.total() == resumed_with * each, name
            if spec["remainder"] == "pad":  # all that was left, the rest repeats of it
                assert not left_of - got_of and set(got_of) == set(left_of), name
            else:  # none of it twice, nothing delivered before
                assert not got_of - left_of, name
        check_epoch(mix, spec["other"], names, rests)

        for slot, dataset in enumerate(resumed):  # the next epoch: the new layout's fresh one
            dataset.set_epoch(spec["epoch"] + 1)
            rests[slot] = pairs(dataset)
        assert rests == mix.run(resumed_with, spec["epoch"] + 1)
        check_epoch(mix, spec["other"], names, rests, resumed[0].counts)
