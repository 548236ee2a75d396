"""Property-based tests of the resumable epoch: order, split, exact and elastic resume.

Random shard counts, samples per shard (empty shards too), world sizes, worker counts,
shuffle buffers, shuffle scopes, seeds, epochs and checkpoint positions. A job of R ranks x
W workers is R*W consumers; consumer ``r*W + w`` is built here as ``rank=r*W+w,
world_size=R*W`` with no DataLoader, which is the same slot a real worker computes
(tests/integration/datasets/test_resume.py runs the real DataLoader, StatefulDataLoader and
torchrun)."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tars import shard_samples, tar_bytes

from shardcache import ResumableDataset, ShardCache, job_state

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def jobs(draw: st.DrawFn) -> dict:
    shards = draw(st.integers(1, 6))
    counts = draw(st.lists(st.integers(0, 9), min_size=shards, max_size=shards))
    counts[0] = max(counts[0], 1)  # a list without any sample is refused (test_epoch_split)
    consumers = draw(st.integers(1, 3)) * draw(st.integers(1, 3))
    remainder = draw(st.sampled_from(["pad", "drop"]))
    if remainder == "drop":  # then each consumer must get at least one sample
        consumers = min(consumers, sum(counts))
    return {
        "counts": counts,
        "consumers": consumers,
        "remainder": remainder,
        "resumed_with": draw(st.integers(1, 3)) * draw(st.integers(1, 3)),
        "buffer": draw(st.sampled_from([0, 1, 3, 8])),
        "seed": draw(st.integers(0, 2**40)),
        "epoch": draw(st.integers(0, 3)),
        "shuffle_shards": (shuffled := draw(st.booleans())),
        "shuffle_scope": draw(st.sampled_from(["cache", "global"])) if shuffled else "cache",
        "fractions": draw(st.lists(st.floats(0, 1), min_size=9, max_size=9)),
        # None: the shards' samples; else fewer (the rest waits) or more (samples repeat)
        "epoch_size": draw(st.none() | st.integers(consumers, 3 * sum(counts) + consumers)),
    }


class Job:
    """Shard files for one example and datasets over them."""

    def __init__(self, root: Path, spec: dict) -> None:
        self.spec = spec
        self.urls = []
        for shard, count in enumerate(spec["counts"]):
            path = root / f"shard-{shard:04d}.tar"
            path.write_bytes(tar_bytes(shard_samples(shard, count, size=8)))
            self.urls.append(str(path))
        self.cache = ShardCache(root / "cache")
        self.keys = [key for s, n in enumerate(spec["counts"]) for key, _ in shard_samples(s, n)]

    def dataset(self, slot: int, consumers: int) -> ResumableDataset:
        dataset = ResumableDataset(
            self.urls,
            seed=self.spec["seed"],
            shuffle_shards=self.spec["shuffle_shards"],
            shuffle_scope=self.spec["shuffle_scope"],
            shuffle_buffer=self.spec["buffer"],
            remainder=self.spec["remainder"],
            epoch_size=self.spec["epoch_size"],
            cache=self.cache,
            threads=1,
            rank=slot,
            world_size=consumers,
        )
        dataset.set_epoch(self.spec["epoch"])
        return dataset

    def run(self, consumers: int) -> list[list[str]]:
        return [[s["__key__"] for s in self.dataset(c, consumers)] for c in range(consumers)]

    def checkpoint(
        self, consumers: int, runs: list[list[str]], *, loaded: dict | None = None, shift: int = 0
    ) -> tuple[list[dict], list[int]]:
        """Each consumer's state after a random part of its run (started from ``loaded``,
        if given), as JSON would keep it, and how many samples each had delivered."""
        states, taken = [], []
        for slot in range(consumers):
            k = round(self.spec["fractions"][(slot + shift) % 9] * len(runs[slot]))
            dataset = self.dataset(slot, consumers)
            if loaded is not None:
                dataset.load_state_dict(loaded)
            iterator = iter(dataset)
            assert [next(iterator)["__key__"] for _ in range(k)] == runs[slot][:k]
            states.append(json.loads(json.dumps(dataset.state_dict())))
            iterator.close()
            taken.append(k)
        return states, taken

    def resume(self, state: dict, slot: int, consumers: int) -> list[str]:
        dataset = self.dataset(slot, consumers)
        dataset.load_state_dict(state)
        return [s["__key__"] for s in dataset]


def check_epoch(spec: dict, keys: list[str], runs: list[list[str]], planned: int) -> None:
    """A fresh epoch: equal runs of ``planned`` samples in all; when they deliver at least
    as many samples as there are keys every key at least once (the rest repeats), else
    none twice."""
    every = Counter(k for run in runs for k in run)
    _equal_shares(spec, runs, planned)
    assert set(every) <= set(keys)
    if every.total() >= len(keys):
        assert set(every) == set(keys)
    else:
        assert max(every.values(), default=1) == 1


def check_resumed(spec: dict, left: Counter[str], runs: list[list[str]], *, split: bool) -> None:
    """What was left of an epoch (a multiset: an epoch above the shards' samples holds
    repeats), resumed: on the same layout exactly that; on another (``split``) equal runs,
    with "pad" every sample left as often as it was left at least (the rest repeats of
    them), with "drop" none more often than it was left."""
    every = Counter(k for run in runs for k in run)
    if not split:
        assert every == left
        return
    _equal_shares(spec, runs, left.total())
    if spec["remainder"] == "drop":
        assert all(every[k] <= left[k] for k in every), every - left
    else:
        assert set(every) == set(left) and not left - every, left - every


def _equal_shares(spec: dict, runs: list[list[str]], planned: int) -> None:
    assert len({len(run) for run in runs}) == 1
    assert sum(len(run) for run in runs) == len(runs) * (
        planned // len(runs) if spec["remainder"] == "drop" else -(-planned // len(runs))
    )


@SETTINGS
@given(jobs())
def test_every_layout_reads_every_sample_once_and_resumes_exactly(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        job = Job(Path(root), spec)
        consumers = spec["consumers"]
        runs = job.run(consumers)
        check_epoch(spec, job.keys, runs, spec["epoch_size"] or len(job.keys))
        assert job.run(consumers) == runs  # deterministic
        states, taken = job.checkpoint(consumers, runs)
        sizes = states[0]["sizes"]
        repeats = Counter(k for run in runs for k in run).total() - len(job.keys)
        assert (sizes["repeated"], sizes["dropped"]) == (max(repeats, 0), max(-repeats, 0))
        for slot in range(consumers):  # each consumer from its own state
            assert job.resume(states[slot], slot, consumers) == runs[slot][taken[slot] :]
        whole = job_state(states)  # and from the job's state
        for slot in range(consumers):
            assert job.resume(whole, slot, consumers) == runs[slot][taken[slot] :]


@SETTINGS
@given(jobs())
def test_another_layout_delivers_every_undelivered_sample(spec: dict) -> None:
    """With padding every sample left comes at least once (and the rest are repeats), with
    dropping at most once; the new consumers get equal shares."""
    with tempfile.TemporaryDirectory() as root:
        job = Job(Path(root), spec)
        consumers, resumed_with = spec["consumers"], spec["resumed_with"]
        runs = job.run(consumers)
        states, taken = job.checkpoint(consumers, runs)
        delivered = [k for slot, run in enumerate(runs) for k in run[: taken[slot]]]
        left = Counter(k for run in runs for k in run) - Counter(delivered)
        whole = job_state(states)
        rests = [job.resume(whole, slot, resumed_with) for slot in range(resumed_with)]
        check_resumed(spec, left, rests, split=resumed_with != consumers)
        assert [job.resume(whole, s, resumed_with) for s in range(resumed_with)] == rests

        # A checkpoint inside the resumed epoch resumes exactly, and elastically again.
        again, again_taken = job.checkpoint(resumed_with, rests, loaded=whole, shift=4)
        for slot in range(resumed_with):
            assert job.resume(again[slot], slot, resumed_with) == rests[slot][again_taken[slot] :]
        also = [k for slot, rest in enumerate(rests) for k in rest[: again_taken[slot]]]
        still = Counter(k for rest in rests for k in rest) - Counter(also)
        final = [job.resume(job_state(again), slot, consumers) for slot in range(consumers)]
        check_resumed(spec, still, final, split=resumed_with != consumers)


@SETTINGS
@given(jobs())
def test_the_next_epoch_after_a_resume_is_the_uninterrupted_next_epoch(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        job = Job(Path(root), spec)
        consumers = spec["consumers"]
        runs = job.run(consumers)
        states, _taken = job.checkpoint(consumers, runs)
        for slot in (0, consumers - 1):
            dataset = job.dataset(slot, consumers)
            dataset.load_state_dict(states[slot])
            list(dataset)
            dataset.set_epoch(spec["epoch"] + 1)
            fresh = job.dataset(slot, consumers)
            fresh.set_epoch(spec["epoch"] + 1)
            assert [s["__key__"] for s in dataset] == [s["__key__"] for s in fresh]
