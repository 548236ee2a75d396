"""The delivery check over local shards: what a job delivered of an epoch against its plan,
at checkpoints, at the epoch's end and on resume, through exact and chained elastic
resumes; a state advanced past samples it did not deliver (or back over samples it did)
is caught with DeliveryMismatchError, or a warning, or not checked, as asked.

Consumer ``slot`` of a job of ``n`` consumers is built as ``rank=slot, world_size=n``
without a DataLoader (the same slot a real worker computes; the torchrun job in
tests/system/test_resume_torchrun.py checks real ranks and workers)."""

from __future__ import annotations

import copy
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tars import shard_samples, tar_bytes

from shardcache import (
    DeliveryMismatchError,
    ResumableDataset,
    ShardCache,
    job_state,
)
from shardcache._observe import metrics

pytestmark = pytest.mark.timeout(300)


class Shards:
    def __init__(self, root: Path, counts: list[int], **options: Any) -> None:
        self.urls = []
        for shard, count in enumerate(counts):
            path = root / f"shard-{shard:04d}.tar"
            path.write_bytes(tar_bytes(shard_samples(shard, count, size=8)))
            self.urls.append(str(path))
        self.root, self.options = root, options

    def dataset(self, slot: int, consumers: int, epoch: int = 0, **env: str) -> ResumableDataset:
        dataset = ResumableDataset(
            self.urls,
            cache=ShardCache(self.root / "cache", **env),
            threads=1,
            rank=slot,
            world_size=consumers,
            **self.options,
        )
        dataset.set_epoch(epoch)
        return dataset

    def states_after(
        self, consumers: int, taken: list[int], loaded: dict | None = None
    ) -> list[dict]:
        """Each consumer's state (as JSON keeps it) after ``taken[slot]`` samples."""
        states = []
        for slot in range(consumers):
            dataset = self.dataset(slot, consumers)
            if loaded is not None:
                dataset.load_state_dict(loaded)
            iterator = iter(dataset)
            for _ in range(taken[slot]):
                next(iterator)
            states.append(json.loads(json.dumps(dataset.state_dict())))
            iterator.close()
        return states

    def finish(self, states: list[dict]) -> tuple[list[dict], int]:
        """Every consumer resumed from its state to its plan's end: the final states and
        the samples delivered on the way."""
        final, delivered = [], 0
        for slot, state in enumerate(states):
            dataset = self.dataset(slot, len(states))
            dataset.load_state_dict(state)
            delivered += sum(1 for _ in dataset)
            final.append(json.loads(json.dumps(dataset.state_dict())))
        return final, delivered


@st.composite
def jobs(draw: st.DrawFn) -> dict:
    shards = draw(st.integers(1, 5))
    counts = draw(st.lists(st.integers(0, 9), min_size=shards, max_size=shards))
    counts[0] = max(counts[0], 1)
    consumers = draw(st.integers(1, 4))
    total = sum(counts)
    return {
        "counts": counts,
        "consumers": min(consumers, total),
        "resumed_with": draw(st.integers(1, 5)),
        "again_with": draw(st.integers(1, 4)),
        "options": {
            "seed": draw(st.integers(0, 2**30)),
            "shuffle_buffer": draw(st.sampled_from([0, 1, 4])),
            "remainder": draw(st.sampled_from(["pad", "drop"])),
            "epoch_size": draw(st.none() | st.integers(12, 2 * total + 12)),
        },
        "fractions": draw(st.lists(st.floats(0, 1), min_size=15, max_size=15)),
    }


def _taken(spec: dict, states: list[dict], offset: int) -> list[int]:
    """A random part of each consumer's share left to deliver."""
    fractions = spec["fractions"]
    return [
        round(fractions[(slot + offset) % 15] * _own_left(state))
        for slot, state in enumerate(states)
    ]


def _own_left(state: dict) -> int:
    return state["sizes"]["own"] - state.get("delivered", 0)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(jobs())
def test_checkpoints_and_epoch_ends_match_through_exact_and_elastic_resumes(spec: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        shards = Shards(Path(root), spec["counts"], **spec["options"])
        n = spec["consumers"]
        starts = shards.states_after(n, [0] * n)
        taken = _taken(spec, starts, 0)
        states = shards.states_after(n, taken)
        check = shards.dataset(0, n).check_delivery(states)
        assert check is not None and check.ok and check.seen.count == sum(taken)
        assert check.at == "checkpoint"

        # elastic into another layout, then a checkpoint there, then elastic again
        total = sum(taken)
        layouts = [spec["resumed_with"], spec["again_with"]]
        loaded = job_state(states)
        for step, m in enumerate(layouts, start=1):
            base = shards.states_after(m, [0] * m, loaded)
            more = _taken(spec, base, 5 * step)
            states = shards.states_after(m, more, loaded)
            total += sum(more)
            check = shards.dataset(0, m).check_delivery(states)
            assert check is not None and check.ok and check.seen.count == total
            loaded = job_state(states)

        # every consumer to its end: the whole epoch's plan, every sample of the chain once
        final, delivered = shards.finish(states)
        check = shards.dataset(0, 1).check_delivery(final, epoch_end=True)
        assert check is not None and check.ok and check.complete
        assert check.seen.count == total + delivered
        if spec["options"]["epoch_size"] is None and spec["options"]["remainder"] == "pad":
            assert check.expected.count >= sum(spec["counts"])  # the shards, plus padding


def _shards(tmp_path: Path, **options: Any) -> Shards:
    return Shards(tmp_path, [13, 9, 11, 7], seed=3, **options)


def _skipped(shards: Shards, consumers: int, slot: int, at: int, skip: int) -> list[dict]:
    """Every consumer's state after ``at`` samples, but consumer ``slot``'s advanced by
    ``skip`` more samples that it did not deliver: its position after ``at + skip``, its
    tally after ``at`` (a batch skipped by a resume)."""
    states = shards.states_after(consumers, [at] * consumers)
    later = shards.states_after(consumers, [at + skip] * consumers)
    forged = copy.deepcopy(later[slot])
    forged["seen"] = states[slot]["seen"]
    forged["delivered"] = states[slot]["delivered"]
    states[slot] = forged
    return states


def test_a_skipped_batch_is_caught_on_resume_and_by_the_job_check(tmp_path: Path) -> None:
    shards = _shards(tmp_path)
    states = _skipped(shards, 2, slot=1, at=4, skip=3)
    with pytest.raises(DeliveryMismatchError, match="3 samples fewer than planned") as caught:
        shards.dataset(0, 2).check_delivery(states)
    error = caught.value
    assert (error.epoch, error.at, error.source) == (0, "checkpoint", None)
    assert error.seen[1] == 8 and error.expected[1] == 11
    assert "SHARDCACHE_DELIVERY_CHECK=warn" in str(error)

    resumed = shards.dataset(1, 2)  # the consumer itself, exactly
    resumed.load_state_dict(states[1])
    with pytest.raises(
        DeliveryMismatchError, match=r"epoch 0, resume of consumer 1 \(of 2\): delivered 4 samples"
    ):
        next(iter(resumed))
    # Elastically, every new consumer checks the whole job state; exactly, the skipping
    # consumer checks its own part of it.
    for slot, consumers in ((0, 3), (2, 3), (1, 2)):
        again = shards.dataset(slot, consumers)
        again.load_state_dict(job_state(states))
        with pytest.raises(DeliveryMismatchError, match="3 samples fewer"):
            next(iter(again))


def test_a_batch_delivered_twice_is_caught(tmp_path: Path) -> None:
    """The position moved back over samples the tally says were delivered."""
    shards = _shards(tmp_path)
    before = shards.states_after(2, [2, 2])
    after = shards.states_after(2, [6, 6])
    rewound = copy.deepcopy(before[0])
    rewound["seen"] = after[0]["seen"]
    with pytest.raises(DeliveryMismatchError, match="4 samples more than planned"):
        shards.dataset(0, 2).check_delivery([rewound, after[1]])


def test_an_epoch_end_check_of_states_short_of_the_end_fails(tmp_path: Path) -> None:
    shards = _shards(tmp_path)
    states = shards.states_after(2, [5, 20])
    assert shards.dataset(0, 2).check_delivery(states).ok  # a checkpoint: fine
    with pytest.raises(DeliveryMismatchError, match=r"end of epoch: .* fewer than planned"):
        shards.dataset(0, 2).check_delivery(states, epoch_end=True)
    final, _ = shards.finish(states)
    assert shards.dataset(0, 2).check_delivery(final, epoch_end=True).complete


def test_warn_and_off_are_the_users_choice(tmp_path: Path, caplog) -> None:
    shards = _shards(tmp_path)
    states = _skipped(shards, 2, slot=0, at=2, skip=2)
    caplog.set_level(logging.WARNING, logger="shardcache")
    check = shards.dataset(0, 2).check_delivery(states, on_mismatch="warn")
    assert check is not None and not check.ok
    assert "2 samples fewer than planned" in caplog.text

    caplog.clear()
    warned = shards.dataset(0, 2, delivery_check="warn")
    warned.load_state_dict(states[0])
    rest = list(warned)  # resumes, warns at the start and at the end of its share
    assert rest and caplog.text.count("fewer than planned") == 2

    caplog.clear()
    off = shards.dataset(0, 2, delivery_check="off")
    off.load_state_dict(states[0])
    assert list(off) == rest and "planned" not in caplog.text
    with pytest.raises(ValueError, match="on_mismatch must be"):
        shards.dataset(0, 2).check_delivery(states, on_mismatch="ignore")


def test_a_state_without_tallies_is_resumed_unchecked(tmp_path: Path, caplog) -> None:
    """A state written by a shardcache that kept no tallies resumes as before."""
    shards = _shards(tmp_path)
    states = shards.states_after(2, [3, 4])
    for state in states:
        del state["seen"], state["prior"]
    caplog.set_level(logging.INFO, logger="shardcache")
    assert shards.dataset(0, 2).check_delivery(states) is None
    assert "without delivery tallies" in caplog.text
    dataset = shards.dataset(0, 3)
    dataset.load_state_dict(job_state(states))  # elastic: the epoch goes on unchecked
    list(dataset)
    assert dataset.state_dict()["seen"] is None


def test_checks_count_in_the_metrics(tmp_path: Path) -> None:
    shards = _shards(tmp_path)
    good = shards.states_after(2, [3, 3])
    bad = _skipped(shards, 2, slot=0, at=1, skip=2)
    made = metrics.collector()
    made.end_epoch()  # a fresh period
    shards.dataset(0, 2).check_delivery(good)
    shards.dataset(0, 2).check_delivery(bad, on_mismatch="warn")
    report = made.end_epoch()
    assert report["delivery_checks"] >= 2 and report["delivery_mismatches"] == 1
    assert "delivery checks" in caplog_line(report)


def caplog_line(report: dict) -> str:
    from shardcache._observe.summary import format_line

    return format_line(report)


def test_samples_a_handler_skips_are_accounted_not_a_mismatch(tmp_path: Path) -> None:
    """A shard missing after its index was made, left out by the handler mid-epoch: its
    samples count as skipped; the checks match, and the tally of what was delivered says
    how many were skipped."""
    from shardcache._datasets.sample_index import index_document, learn, write_index

    shards = _shards(tmp_path, shuffle_buffer=4)
    cache = ShardCache(tmp_path / "cache")
    index = str(tmp_path / "index.json")
    write_index(index, index_document(learn(shards.urls, cache, threads=1), shards.urls))
    Path(shards.urls[2]).unlink()  # 11 samples
    shards.options.update(index=index, handler=lambda exn: True)
    dataset = shards.dataset(0, 1)
    delivered = list(dataset)
    state = dataset.state_dict()
    assert len(delivered) == 13 + 9 + 7
    assert state["skipped"][1] == 11 and state["seen"][1] == 29
    check = shards.dataset(0, 1).check_delivery([state], epoch_end=True)
    assert check.ok and check.skipped.count == 11 and check.expected.count == 40
