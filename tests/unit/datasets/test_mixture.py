"""MixtureDataset: sources at set proportions, equal shares, and exact and elastic resume,
over local shards (the schedule's bounds as properties of the pure functions)."""

from __future__ import annotations

import base64
import copy
import json
import math
import shutil
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tars import shard_samples, tar_bytes
from torchdata.stateful_dataloader import StatefulDataLoader

import shardcache
from shardcache import ConfigError, MixtureDataset, ResumeError, ShardCache, Source
from shardcache._datasets.interleave import _online, next_source, picks
from shardcache._datasets.mixture_schedule import epoch_counts

pytestmark = pytest.mark.timeout(120)
SOURCES = {"web": (12, 9, 15, 7), "code": (6, 5), "books": (4,)}  # samples per shard


@pytest.fixture
def spec_of(tmp_path: Path) -> dict[str, list[str]]:
    """Each source's shard files; keys name the source (``web-s<shard>-<i>``...)."""
    urls: dict[str, list[str]] = {}
    shard = 0
    for name, counts in SOURCES.items():
        urls[name] = []
        for count in counts:
            path = tmp_path / name / f"{shard:04d}.tar"
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(tar_bytes(shard_samples(shard, count, size=8)))
            urls[name].append(str(path))
            shard += 1
    return urls


def keys_of(spec_of: dict[str, list[str]], name: str) -> set[str]:
    first = sum(len(SOURCES[n]) for n in list(SOURCES)[: list(SOURCES).index(name)])
    return {
        key for i, count in enumerate(SOURCES[name]) for key, _ in shard_samples(first + i, count)
    }


def mixture(tmp_path: Path, spec_of: dict, rank: int, world: int, **options) -> MixtureDataset:
    weights = options.pop("weights", {"web": 0.5, "code": 0.3, "books": 0.2})
    return MixtureDataset(
        [Source(spec_of[n], weight=w, name=n) for n, w in weights.items()],
        epoch_size=options.pop("epoch_size", 60),
        seed=options.pop("seed", 4),
        cache=options.pop("cache", None) or ShardCache(tmp_path / "cache"),
        threads=1,
        rank=rank,
        world_size=world,
        **options,
    )


def run(dataset: MixtureDataset) -> list[tuple[str, str]]:
    return [(s["__source__"], s["__key__"]) for s in dataset]


# -- the pure parts ---------------------------------------------------------------------


def test_epoch_counts_split_the_epoch_by_weight_and_add_up_exactly() -> None:
    sources = [Source("a", weight=0.5), Source("b", weight=0.3), Source("c", weight=0.2)]
    assert epoch_counts(sources, 10) == [5, 3, 2]
    assert epoch_counts(sources, 7) == [4, 2, 1]  # 3.5, 2.1, 1.4: the largest remainders
    assert sum(epoch_counts(sources, 1001)) == 1001
    mixed = [Source("a", weight=1), Source("b", samples=30), Source("c", weight=3)]
    assert epoch_counts(mixed, 70) == [10, 30, 30]
    assert epoch_counts([Source("a", samples=3), Source("b", samples=0)], None) == [3, 0]
    assert epoch_counts([Source("a", samples=5), Source("b", weight=0)], 5) == [5, 0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=7).filter(any))
def test_every_prefix_holds_each_source_less_than_one_sample_off(shares: list[int]) -> None:
    """Tijdeman's bound: ``1 - 1/(2k - 2)`` for ``k`` sources with samples."""
    taken = [0] * len(shares)
    total, k = sum(shares), sum(1 for share in shares if share)
    bound = 1 - Fraction(1, 2 * k - 2) if k > 1 else 0
    for t in range(1, total + 1):
        taken[next_source(taken, shares)] += 1
        for done, share in zip(taken, shares, strict=True):
            assert abs(done - Fraction(t * share, total)) <= bound
    assert taken == shares and next_source(taken, shares) == -1


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 30), min_size=2, max_size=4),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 8),
    st.integers(1, 5),
)
def test_a_window_of_global_batches_holds_each_source_within_the_stated_bound(
    shares: list[int], ranks: int, workers: int, batch: int, window: int
) -> None:
    """Each worker mixes the same shares; a DataLoader takes its workers' batches in turn;
    a global batch is every rank's batch of one step. In any ``window`` global batches a
    source is less than ``2 * ranks * min(window, workers)`` samples off its share."""
    per_worker = []
    for _ in range(workers):
        taken, order = [0] * len(shares), []
        while (i := next_source(taken, shares)) >= 0:
            taken[i] += 1
            order.append(i)
        per_worker.append([order[b : b + batch] for b in range(0, len(order), batch)])
    steps = [per_worker[s % workers][s // workers] for s in range(len(per_worker[0]) * workers)]
    total = sum(shares)
    for start in range(len(steps) - window + 1):
        batches = steps[start : start + window]
        counts = Counter(i for b in batches for i in b)
        size = sum(len(b) for b in batches)
        for i, share in enumerate(shares):
            deviation = abs(ranks * counts[i] - ranks * size * share / total)
            assert deviation < 2 * ranks * min(window, workers)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=5).filter(any), st.data())
def test_picks_from_the_kept_order_are_next_sources_picks(shares: list[int], data) -> None:
    """From no sample taken, any prefix of the order, or counts off every prefix (a source
    that ended early), picks() gives next_source's picks."""
    order = list(_online([0] * len(shares), shares))
    assert list(picks([0] * len(shares), shares)) == order
    step = data.draw(st.integers(0, len(order)))
    taken = [order[:step].count(i) for i in range(len(shares))]
    assert list(picks(taken, shares)) == order[step:]
    off = [max(0, done - data.draw(st.integers(0, 2))) for done in taken]
    assert list(picks(off, shares)) == list(_online(off, shares))


# -- the dataset --------------------------------------------------------------------------


def test_every_consumer_gets_the_same_share_of_each_source(tmp_path: Path, spec_of) -> None:
    world = 3
    runs = [run(mixture(tmp_path, spec_of, rank, world)) for rank in range(world)]
    # 60 samples: 30 web, 18 code, 12 books, each split 10 / 6 / 4 between 3 ranks
    for samples in runs:
        assert Counter(source for source, _ in samples) == {"web": 10, "code": 6, "books": 4}
        for t in range(1, len(samples) + 1):  # every prefix less than a sample off its share
            prefix = Counter(source for source, _ in samples[:t])
            assert all(abs(prefix[n] - t * c / 20) < 1 for n, c in (("web", 10), ("code", 6)))
    by_source: dict[str, Counter[str]] = {n: Counter() for n in SOURCES}
    for samples in runs:
        for source, key in samples:
            by_source[source][key] += 1
    # web (43 samples) gives 30: no sample twice; code (11) gives 18 and books (4) 12: all
    # samples, the rest repeats.
    assert max(by_source["web"].values()) == 1 and set(by_source["web"]) <= keys_of(spec_of, "web")
    for name in ("code", "books"):
        assert set(by_source[name]) == keys_of(spec_of, name)
        assert by_source[name].total() == {"code": 18, "books": 12}[name]


def test_a_down_sampled_source_cycles_through_its_samples_over_epochs(
    tmp_path: Path, spec_of
) -> None:
    dataset = mixture(tmp_path, spec_of, 0, 1)
    seen: Counter[str] = Counter()
    for epoch in range(2):  # 30 web samples an epoch of 43
        dataset.set_epoch(epoch)
        seen.update(key for source, key in run(dataset) if source == "web")
    assert set(seen) == keys_of(spec_of, "web") and max(seen.values()) == 2


@pytest.mark.parametrize("taken", [0, 7, 19])
def test_a_consumer_resumes_exactly_from_its_state(tmp_path: Path, spec_of, taken: int) -> None:
    whole = run(mixture(tmp_path, spec_of, 1, 2, shuffle_buffer=3))
    dataset = mixture(tmp_path, spec_of, 1, 2, shuffle_buffer=3)
    iterator = iter(dataset)
    assert [(s["__source__"], s["__key__"]) for s in _take(iterator, taken)] == whole[:taken]
    state = json.loads(json.dumps(dataset.state_dict()))
    iterator.close()
    resumed = mixture(tmp_path, spec_of, 1, 2, shuffle_buffer=3)
    resumed.load_state_dict(state)
    assert run(resumed) == whole[taken:]


def test_an_elastic_resume_delivers_every_undelivered_sample(tmp_path: Path, spec_of) -> None:
    world = 2
    whole = [run(mixture(tmp_path, spec_of, rank, world)) for rank in range(world)]
    states, delivered = [], Counter()
    for rank, taken in zip(range(world), (5, 13), strict=True):
        dataset = mixture(tmp_path, spec_of, rank, world)
        iterator = iter(dataset)
        delivered.update(_pairs(_take(iterator, taken)))
        states.append(json.loads(json.dumps(dataset.state_dict())))
        iterator.close()
    left = Counter(p for samples in whole for p in samples) - delivered
    gathered = shardcache.job_state(states)
    rests = []
    for rank in range(3):
        dataset = mixture(tmp_path, spec_of, rank, 3)
        dataset.load_state_dict(gathered)
        rests.append(run(dataset))
    got = Counter(p for rest in rests for p in rest)
    assert set(got) == set(left)  # every sample left, the shortfall of shares repeating
    for name in SOURCES:  # each source's leftover split equally between the 3 consumers
        counts = {Counter(s for s, _ in rest)[name] for rest in rests}
        assert len(counts) == 1
        left_of = sum(n for (s, _), n in left.items() if s == name)
        assert counts.pop() == math.ceil(left_of / 3)


def test_a_state_of_another_mixture_is_refused_naming_what_changed(tmp_path: Path, spec_of) -> None:
    dataset = mixture(tmp_path, spec_of, 0, 1)
    iterator = iter(dataset)
    _take(iterator, 3)
    state = dataset.state_dict()
    iterator.close()
    other = mixture(tmp_path, spec_of, 0, 1, weights={"web": 0.5, "code": 0.5})
    with pytest.raises(ResumeError, match=r"sources \['web', 'code', 'books'\], this one"):
        other.load_state_dict(state)
    reweighted = mixture(tmp_path, spec_of, 0, 1, weights={"web": 0.6, "code": 0.2, "books": 0.2})
    with pytest.raises(
        ResumeError, match=r"epoch 0, step 0: source 'web' weight 0.5 in the state, 0.6"
    ) as e:
        reweighted.load_state_dict(state)
    assert (e.value.source, e.value.seen, e.value.expected) == ("web", 0.5, 0.6)
    longer = mixture(tmp_path, spec_of, 0, 1, epoch_size=70)  # the same weights, other counts
    with pytest.raises(ResumeError, match=r"source 'web' samples 30 in the state, 35 in this"):
        longer.load_state_dict(state)


@pytest.mark.parametrize(
    ("sources", "epoch_size", "message"),
    [
        ([Source("a", weight=-1)], 10, "source 'source-0': weight must be a finite number >= 0"),
        ([Source("a", weight=math.nan)], 10, "weight must be a finite number"),
        ([Source("a", weight="1")], 10, "weight must be a finite number"),  # type: ignore[arg-type]
        ([Source("a", weight=True)], 10, "weight must be a finite number"),
        ([Source("a", weight=0), Source("b", weight=0)], 10, "every source has weight 0"),
        ([Source("a", weight=0), Source("b", samples=5)], 10, "leaves 5 samples to the"),
        ([Source("a")], 10, "give exactly one of weight="),
        ([Source("a", weight=1, samples=3)], 10, "give exactly one of weight="),
        ([Source("a", samples=-2)], None, "samples must be a whole number >= 0"),
        ([Source("a", weight=1)], None, "a mixture with weights needs epoch_size"),
        ([Source("a", weight=1)], 0, "epoch_size must be a whole number >= 1, not 0"),
        ([Source("a", weight=1), Source("b", samples=20)], 10, "smaller than the 20 samples"),
        ([Source("a", samples=1, name="x"), Source("b", samples=1, name="x")], None, "differ"),
        ([], None, "non-empty list of shardcache.Source"),
        (["a"], None, "must be a shardcache.Source"),
    ],
)
def test_bad_sources_are_config_errors_naming_the_source(
    tmp_path: Path, sources: list, epoch_size: int | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        MixtureDataset(sources, epoch_size=epoch_size, cache=ShardCache(tmp_path / "c"))


def test_a_source_that_gets_no_sample_is_left_out(tmp_path: Path, spec_of) -> None:
    dataset = mixture(tmp_path, spec_of, 0, 1, weights={"web": 1, "code": 0}, epoch_size=9)
    assert dataset.names == ["web"] and {s for s, _ in run(dataset)} == {"web"}
    with pytest.raises(ConfigError, match="the mixture gets no sample an epoch"):
        MixtureDataset([Source(spec_of["web"], samples=0)], cache=ShardCache(tmp_path / "c"))


def test_an_unusable_source_is_named(tmp_path: Path, spec_of) -> None:
    with pytest.raises(shardcache.UrlError, match="source 'bad': ") as caught:
        MixtureDataset(
            [Source(spec_of["web"], weight=1, name="web"), Source("x{1..}", weight=1, name="bad")],
            epoch_size=10,
            cache=ShardCache(tmp_path / "c"),
        )
    assert caught.value.source == "bad"


def test_a_source_with_fewer_samples_than_consumers_goes_to_some_of_them(
    tmp_path: Path, spec_of
) -> None:
    """12 samples an epoch for 2 consumers: web's 11 give 6 and 5, books' 1 goes to the
    consumer web gave one fewer; a mixture of fewer samples than consumers is refused."""

    def small(rank: int, world: int, web: int = 11) -> MixtureDataset:
        return MixtureDataset(
            [
                Source(spec_of["web"], samples=web, name="web"),
                Source(spec_of["books"], samples=1, name="books"),
            ],
            cache=ShardCache(tmp_path / "c"),
            threads=1,
            rank=rank,
            world_size=world,
        )

    got = [Counter(s["__source__"] for s in small(rank, 2)) for rank in range(2)]
    assert got == [{"web": 6}, {"web": 5, "books": 1}]
    with pytest.raises(ConfigError, match="epoch_size=3 is smaller than the job's 4 consumers"):
        list(small(0, 4, web=2))


def test_a_stateful_dataloader_with_workers_resumes_a_mixture(tmp_path: Path, spec_of) -> None:
    """2 DataLoader workers (processes): the loader's state after batch 4 resumes exactly
    with 2 workers, and, gathered by ``job_state``, with 3 (every sample left once more,
    the shortfall of equal shares repeating)."""

    def loader_of(dataset: MixtureDataset, workers: int) -> StatefulDataLoader:
        return StatefulDataLoader(
            dataset, batch_size=4, num_workers=workers, collate_fn=_pairs, timeout=60
        )

    whole = list(loader_of(mixture(tmp_path, spec_of, 0, 1), 2))
    loader = loader_of(mixture(tmp_path, spec_of, 0, 1), 2)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(4)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    assert first == whole[:4]
    again = loader_of(mixture(tmp_path, spec_of, 0, 1), 2)
    again.load_state_dict(state)
    assert first + list(again) == whole

    left = Counter(p for batch in whole for p in batch) - Counter(p for b in first for p in b)
    elastic = mixture(tmp_path, spec_of, 0, 1)
    elastic.load_state_dict(shardcache.job_state(state))
    rest = Counter(p for batch in loader_of(elastic, 3) for p in batch)
    assert set(rest) == set(left)


def _take(iterator, count: int) -> list[dict]:
    return [next(iterator) for _ in range(count)]


def _pairs(samples: list[dict]) -> list[tuple[str, str]]:
    return [(s["__source__"], s["__key__"]) for s in samples]


# -- per-source counts ------------------------------------------------------------------


def test_delivery_is_checked_per_source(tmp_path: Path, spec_of) -> None:
    """Each source's tally against its plan (tests/unit/datasets/test_delivery_check.py
    checks the tallies themselves): at a checkpoint, forged, and at the end of an epoch
    resumed elastically."""
    states = []
    for slot in range(2):
        dataset = mixture(tmp_path, spec_of, slot, 2, shuffle_buffer=3)
        iterator = iter(dataset)
        _take(iterator, 7 + slot)
        states.append(json.loads(json.dumps(dataset.state_dict())))
        iterator.close()
    checks = mixture(tmp_path, spec_of, 0, 2, shuffle_buffer=3).check_delivery(states)
    assert set(checks) == {"web", "code", "books"}
    assert all(c is not None and c.ok for c in checks.values())
    assert sum(c.seen.count for c in checks.values() if c is not None) == 15

    forged = copy.deepcopy(states)
    forged[1]["states"][0]["seen"] = states[0]["states"][0]["seen"]  # web's tally of another
    with pytest.raises(shardcache.DeliveryMismatchError, match="source 'web'") as caught:
        mixture(tmp_path, spec_of, 0, 2, shuffle_buffer=3).check_delivery(forged)
    assert caught.value.source == "web"

    final = []  # elastically into 3 consumers, to the epoch's end: whole
    for slot in range(3):
        dataset = mixture(tmp_path, spec_of, slot, 3, shuffle_buffer=3)
        dataset.load_state_dict(shardcache.job_state(states))
        assert run(dataset)
        final.append(dataset.state_dict())
    checks = mixture(tmp_path, spec_of, 0, 1, shuffle_buffer=3).check_delivery(
        final, epoch_end=True
    )
    assert all(c is not None and c.ok and c.complete for c in checks.values())


def test_the_loader_report_counts_each_source(tmp_path: Path, spec_of, caplog) -> None:
    """One epoch record an epoch (not one per source), the samples, misses and bytes of
    each source, and the rank's line naming them: in-process, then with 2 forked workers
    whose spooled totals the training process merges."""
    records: list[dict] = []
    shardcache.add_metrics_sink(records.append)
    sizes = {n: sum(Path(u).stat().st_size for u in urls) for n, urls in spec_of.items()}
    dataset = mixture(tmp_path, spec_of, 0, 1)
    with caplog.at_level("INFO", logger="shardcache"):
        got = Counter(source for source, _ in run(dataset))
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(epochs) == 1 and epochs[0]["samples"] == 60
    report = shardcache.log_epoch_summary(0)
    assert (
        {n: c["samples"] for n, c in report["sources"].items()}
        == got
        == {
            "web": 30,
            "code": 18,
            "books": 12,
        }
    )
    # The sample index was learned by fetching every shard once (a miss each); reading
    # them was a hit each time a piece of one was opened.
    for name, counts in report["sources"].items():
        assert counts["misses"] == len(spec_of[name]), name
        assert counts["bytes_downloaded"] == sizes[name], name
        assert counts["hits"] > 0, name
    assert sum(c["misses"] for c in report["sources"].values()) == report["misses"]
    assert "by source: books 12 samples (" in caplog.text

    records.clear()
    dataset.set_epoch(1)
    loader = StatefulDataLoader(dataset, batch_size=4, num_workers=2, collate_fn=_pairs, timeout=60)
    got = Counter(source for batch in loader for source, _ in batch)
    report = shardcache.log_epoch_summary(1)
    assert {n: c["samples"] for n, c in report["sources"].items()} == got
    assert got.total() == 60 and all(c["misses"] == 0 for c in report["sources"].values())


def _no_interleaving_here(_worker_id: int) -> None:
    """A DataLoader worker that must not compute an interleaving (prepare() handed it)."""
    import shardcache._datasets.interleave as interleave_module

    def refuse(*_args: object) -> None:
        raise AssertionError("a DataLoader worker computed the interleaving")

    interleave_module._online = refuse


def _two_workers(
    dataset: MixtureDataset, refuse: bool = True, how: str = "fork"
) -> StatefulDataLoader:
    """Two workers reading ``dataset`` in batches of 4; ``refuse``: a worker that computes
    an interleaving fails."""
    return StatefulDataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        collate_fn=_pairs,
        worker_init_fn=_no_interleaving_here if refuse else None,
        multiprocessing_context=how,
    )


def test_prepare_hands_each_worker_its_interleaving(tmp_path: Path, spec_of) -> None:
    """prepare(workers=2) computes the interleavings of rank 1's 2 workers (of 2 ranks:
    their counts differ) in the training process; the workers, forked (every epoch) or
    spawned, read the same batches as workers that compute their own, without computing
    one. Without it they compute their own."""
    from shardcache._datasets.interleave import _order

    def dataset_of() -> MixtureDataset:
        return mixture(tmp_path, spec_of, 1, 2, epoch_size=62)  # 64 a worker: 31 / 19 / 12 + 2

    expected, got = [], []
    reference, prepared = dataset_of(), dataset_of()
    for epoch in (0, 1):
        reference.set_epoch(epoch)
        expected.append(list(_two_workers(reference, refuse=False)))
    _order.cache_clear()  # nothing inherited from this process
    prepared.prepare(workers=2)
    assert len(prepared._orders) == 2  # the two workers' counts differ
    for epoch in (0, 1):
        prepared.set_epoch(epoch)
        got.append(list(_two_workers(prepared)))
    assert got == expected
    assert list(_two_workers(prepared, how="spawn")) == expected[1]  # handed over by pickle

    shutil.rmtree(tmp_path / "cache" / ".orders")  # what the reference's workers kept
    _order.cache_clear()
    with pytest.raises(AssertionError, match="a DataLoader worker computed the interleaving"):
        list(_two_workers(dataset_of().prepare()))


def test_unprepared_workers_compute_their_interleaving_in_the_first_epoch_only(
    tmp_path: Path, spec_of
) -> None:
    """Without prepare(workers=), the workers of the first epoch compute their orders and
    keep them in the cache root; the next epochs' workers (new processes) and another
    dataset on the same cache read them, computing none, with the same batches. A damaged
    kept order is computed again."""
    from shardcache._datasets.interleave import _order

    reference = mixture(tmp_path, spec_of, 1, 2, epoch_size=62, cache=ShardCache(tmp_path / "c0"))
    expected = []
    for epoch in (0, 1):
        reference.set_epoch(epoch)
        expected.append(list(_two_workers(reference, refuse=False)))
    _order.cache_clear()  # nothing inherited from this process
    dataset = mixture(tmp_path, spec_of, 1, 2, epoch_size=62)
    assert list(_two_workers(dataset, refuse=False)) == expected[0]
    kept = sorted((tmp_path / "cache" / ".orders").iterdir())
    assert len(kept) == 2  # one a worker: their counts differ
    dataset.set_epoch(1)
    assert list(_two_workers(dataset, refuse=True)) == expected[1]
    again = mixture(tmp_path, spec_of, 1, 2, epoch_size=62)
    assert list(_two_workers(again, refuse=True)) == expected[0]

    kept[0].write_text(kept[0].read_text().replace('"order": "A', '"order": "B'))
    with pytest.raises(AssertionError, match="a DataLoader worker computed the interleaving"):
        list(_two_workers(again, refuse=True))


def test_a_kept_order_is_read_only_for_its_own_counts_and_a_root_that_cannot_keep_one_computes(
    tmp_path: Path,
) -> None:
    """Stored: an order written is read back for its counts only; one damaged (counts off)
    is not read; a cache root where none can be written keeps nothing and raises nothing."""
    from shardcache._datasets.interleave import Stored, _order

    stored = Stored(ShardCache(tmp_path / "cache").layout)
    shares = (5, 3, 2)
    assert stored.read(shares) is None
    _order.cache_clear()
    computed = _order(shares, stored)
    assert computed == bytes(_online([0, 0, 0], shares))
    assert stored.read(shares) == computed and stored.read((5, 2, 3)) is None
    path = stored.path(shares)
    document = json.loads(path.read_text())
    document["order"] = base64.b64encode(b"\x02" * len(computed)).decode()  # counts off
    path.write_text(json.dumps(document))
    assert stored.read(shares) is None

    other = Stored(ShardCache(tmp_path / "other").layout)
    (tmp_path / "other").mkdir(exist_ok=True)
    (tmp_path / "other" / ".orders").write_text("a file where the folder goes")
    _order.cache_clear()
    assert _order((4, 4), other) == bytes(_online([0, 0], (4, 4)))
    assert other.read((4, 4)) is None
