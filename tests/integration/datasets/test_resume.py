"""ResumableDataset over a moto S3 server: StatefulDataLoader with real workers (exact and
elastic), the plain JSON state without torchdata, cold-cache resume while downloading, and
every refusal of a state that does not fit."""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
from tars import shard_samples, tar_bytes
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import shardcache
from shardcache import (
    ConfigError,
    ResumableDataset,
    ResumeError,
    SampleIndexError,
    ShardCache,
    job_state,
)
from shardcache._datasets.resume_start import plan_for
from shardcache._datasets.sample_index import index_document, learn, write_index

BUCKET = "resume"
SHARDS = 6
PER_SHARD = 13  # odd: batches of 3 end mid-shard
SPEC = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
ALL_KEYS = [key for s in range(SHARDS) for key, _ in shard_samples(s, PER_SHARD)]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def dataset_s3(s3) -> str:
    s3.put_objects(
        BUCKET,
        {f"train-{i:06d}.tar": tar_bytes(shard_samples(i, PER_SHARD)) for i in range(SHARDS)},
    )
    return SPEC


def keys_of(batch: list[dict[str, Any]]) -> list[str]:
    return [sample["__key__"] for sample in batch]


def _dataset(cache_dir: Path, **options: Any) -> ResumableDataset:
    options = {"seed": 11, "shuffle_buffer": 5, "rank": 0, "world_size": 1, **options}
    return ResumableDataset(SPEC, cache=ShardCache(cache_dir), threads=2, **options)


def _loader(dataset: ResumableDataset, workers: int = 2) -> StatefulDataLoader:
    return StatefulDataLoader(
        dataset, batch_size=3, num_workers=workers, collate_fn=keys_of, timeout=60
    )


def _epochs(loader: StatefulDataLoader, dataset: ResumableDataset, epochs: range) -> list:
    batches = []
    for epoch in epochs:
        dataset.set_epoch(epoch)
        batches += [(epoch, keys) for keys in loader]
    return batches


def _run_until(cache_dir: Path, steps: set[int], workers: int = 2) -> tuple[list, dict]:
    """Batches of two epochs; the loader's state (JSON round trip) after each of ``steps``."""
    dataset = _dataset(cache_dir)
    loader = _loader(dataset, workers)
    batches, states = [], {}
    for epoch in range(2):
        dataset.set_epoch(epoch)
        for keys in loader:
            batches.append((epoch, keys))
            if len(batches) in steps:
                states[len(batches)] = json.loads(json.dumps(loader.state_dict()))
    return batches, states


def test_stateful_dataloader_resumes_exactly_from_any_batch(dataset_s3, tmp_path: Path) -> None:
    steps = set(range(1, 53, 2))  # every other batch of both epochs: mid-shard, at shard ends
    batches, states = _run_until(tmp_path / "cache", steps)
    assert len(batches) == 52  # per epoch: 3 shards of 13 per worker, 13 batches of 3 each
    for epoch in (0, 1):
        keys = [k for e, ks in batches if e == epoch for k in ks]
        assert sorted(keys) == sorted(ALL_KEYS)
    first = [k for e, ks in batches if e == 0 for k in ks]
    second = [k for e, ks in batches if e == 1 for k in ks]
    assert first != second  # each epoch has its own order
    for step in sorted(steps):
        dataset = _dataset(tmp_path / "cache")
        loader = _loader(dataset)
        loader.load_state_dict(states[step])
        epoch = batches[step - 1][0]
        assert batches[:step] + _epochs(loader, dataset, range(epoch, 2)) == batches, step


def test_elastic_resume_with_another_worker_count_delivers_the_rest_once(
    dataset_s3, tmp_path: Path
) -> None:
    batches, states = _run_until(tmp_path / "cache", {5, 11})
    for step in (5, 11):
        delivered = [k for _e, ks in batches[:step] for k in ks]
        for workers in (1, 3):
            dataset = _dataset(tmp_path / "cache")
            dataset.load_state_dict(job_state(states[step]))
            rest = _epochs(_loader(dataset, workers), dataset, range(1))
            keys = delivered + [k for _e, ks in rest for k in ks]
            assert Counter(keys) == Counter(ALL_KEYS), (step, workers)


def _rank_epochs(
    cache_dir: Path, world: int, start: tuple[int, dict] | None = None, **options: Any
) -> dict[int, list]:
    """Each rank's batches of epochs 0..2 (rank ``r`` through its own cache, one DataLoader
    worker), or from ``start`` (an epoch, and the loaders' states by rank) on; without
    ``start``, the loaders' states after each batch too (by step, under "states")."""
    out: dict[int, list] = {}
    for rank in range(world):
        dataset = _dataset(cache_dir / f"rank-{rank}", rank=rank, world_size=world, **options)
        loader = _loader(dataset, workers=1)
        if start is not None:
            loader.load_state_dict(start[1][rank])
        batches: list = []
        for epoch in range(0 if start is None else start[0], 3):
            dataset.set_epoch(epoch)
            for keys in loader:
                state = None if start else json.loads(json.dumps(loader.state_dict()))
                batches.append((epoch, keys, state))
        out[rank] = batches
    return out


def test_a_global_shuffle_deals_every_epoch_anew_and_resumes_exactly_and_elastically(
    dataset_s3, tmp_path: Path
) -> None:
    run = _rank_epochs(tmp_path, 2, shuffle_scope="global")
    owner = {key: s for s in range(SHARDS) for key, _ in shard_samples(s, PER_SHARD)}

    def keys(rank: int, epoch: int, upto: int | None = None) -> list[str]:
        return [k for e, ks, _ in run[rank][:upto] if e == epoch for k in ks]

    assert len(run[0]) == len(run[1]) == 3 * 13  # equal batches: 39 samples a rank an epoch
    for epoch in (0, 1, 2):  # every sample once an epoch
        assert Counter(keys(0, epoch) + keys(1, epoch)) == Counter(ALL_KEYS), epoch
    shards = [[{owner[k] for k in keys(rank, epoch)} for epoch in (0, 1, 2)] for rank in (0, 1)]
    assert shards[0][1:] != [shards[0][0]] * 2  # the ranks' shards move between epochs
    local = _rank_epochs(tmp_path / "local", 2)  # epoch 0's deal: the cache-local hand-out
    assert [{owner[k] for e, ks, _ in local[r] if e == 0 for k in ks} for r in (0, 1)] == [
        shards[0][0],
        shards[1][0],
    ]
    for step in (4, 17):  # mid epoch 0, mid epoch 1
        epoch, states = run[0][step - 1][0], {r: run[r][step - 1][2] for r in (0, 1)}
        resumed = _rank_epochs(tmp_path, 2, (epoch, states), shuffle_scope="global")
        for rank in (0, 1):  # exact: the rest of the uninterrupted run
            rest = [(e, ks) for e, ks, _ in resumed[rank]]
            assert rest == [(e, ks) for e, ks, _ in run[rank][step:]], (step, rank)
        job = job_state(*states.values())
        dataset = _dataset(tmp_path / "rank-0", shuffle_scope="global")  # elastic: one rank
        dataset.load_state_dict(job)
        rest_keys = [
            k
            for _e, ks in _epochs(_loader(dataset, 1), dataset, range(epoch, epoch + 1))
            for k in ks
        ]
        delivered = keys(0, epoch, step) + keys(1, epoch, step)
        assert Counter(delivered + rest_keys) == Counter(ALL_KEYS), step
        with pytest.raises(ResumeError, match="shuffle_scope='global'; this dataset has"):
            _dataset(tmp_path / "rank-0").load_state_dict(job)


def test_a_cold_cache_resumes_while_downloading(dataset_s3, tmp_path: Path, s3) -> None:
    batches, states = _run_until(tmp_path / "warm", {7, 45})
    # With the sample index made ahead; without it the dataset learns it by fetching every
    # shard before the first sample.
    urls = shardcache.expand_urls(SPEC)
    index = str(tmp_path / "train.index.json")
    learned = learn(urls, ShardCache(tmp_path / "warm"), threads=2)
    write_index(index, index_document(learned, urls))

    def whole_gets() -> int:  # a whole shard's fetch is one GET of the whole object (200)
        return sum(1 for r in s3.requests("GET", f"/{BUCKET}/train-") if r.status == 200)

    fetched = {}
    for step in (7, 45):
        before = whole_gets()
        dataset = _dataset(tmp_path / f"cold-{step}", index=index)  # empty: read while downloading
        loader = _loader(dataset)
        loader.load_state_dict(states[step])
        epoch = batches[step - 1][0]
        assert batches[:step] + _epochs(loader, dataset, range(epoch, 2)) == batches
        fetched[step] = whole_gets() - before  # whole shards fetched
    # From early in epoch 0 every shard is read again (the rest of epoch 0 or epoch 1); late
    # in epoch 1 each worker reads its third shard: shards delivered whole are skipped without
    # a byte fetched, and buffered samples of finished shards come by ranged reads
    # (test_a_cold_resume_reads_buffered_samples_of_finished_shards_by_ranged_requests).
    assert fetched[7] == SHARDS
    assert fetched[45] < SHARDS


def test_plain_state_without_torchdata(dataset_s3, tmp_path: Path) -> None:
    """A torch DataLoader without workers (or any loop over the dataset): the dataset's
    own state_dict(), stored as JSON."""
    dataset = _dataset(tmp_path / "cache")
    loader = DataLoader(dataset, batch_size=4, collate_fn=keys_of)
    full = [keys for keys in loader]
    iterator = iter(loader)
    head = [next(iterator) for _ in range(6)]
    saved = json.dumps(dataset.state_dict())
    del iterator
    resumed = _dataset(tmp_path / "cache")
    resumed.load_state_dict(json.loads(saved))
    assert head + list(DataLoader(resumed, batch_size=4, collate_fn=keys_of)) == full


def test_compose_applies_webdataset_stages_after_the_state(dataset_s3, tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "cache", shuffle_buffer=0).compose(
        wds.to_tuple("__key__", "cls"), wds.map_tuple(None, int)
    )
    iterator = iter(dataset)
    first = [next(iterator) for _ in range(4)]
    assert all(isinstance(cls, int) for _key, cls in first)
    state = dataset.state_dict()
    assert state["delivered"] == 4
    rest = _dataset(tmp_path / "cache", shuffle_buffer=0)
    rest.load_state_dict(state)
    whole = [key for key, _cls in first] + [s["__key__"] for s in rest]
    assert sorted(whole) == sorted(ALL_KEYS)


def test_the_dataset_pickles_into_spawned_workers(dataset_s3, tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "cache")
    pickle.loads(pickle.dumps(dataset))
    loader = StatefulDataLoader(
        dataset,
        batch_size=3,
        num_workers=2,
        collate_fn=keys_of,
        multiprocessing_context=mp.get_context("spawn"),
    )
    assert sorted(k for ks in loader for k in ks) == sorted(ALL_KEYS)


# ------------------------------------------------------------------ refused states
def _state_after(dataset: ResumableDataset, count: int) -> dict:
    iterator = iter(dataset)
    for _ in range(count):
        next(iterator)
    state = dataset.state_dict()
    iterator.close()
    return state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 12}, "taken with seed=11; this dataset has seed=12"),
        ({"shuffle_shards": False}, "shuffle_shards=True; this dataset has shuffle_shards=False"),
        ({"epoch_size": 40}, "epoch_size=None; this dataset has epoch_size=40"),
        (
            {"shuffle_scope": "global"},
            "taken with shuffle_scope='cache'; this dataset has shuffle_scope='global'",
        ),
    ],
)
def test_a_state_of_another_seed_or_order_is_refused(
    dataset_s3, tmp_path: Path, change: dict, message: str
) -> None:
    state = _state_after(_dataset(tmp_path / "cache"), 4)
    with pytest.raises(ResumeError, match=message):
        _dataset(tmp_path / "cache", **change).load_state_dict(state)


def test_a_state_of_another_shard_list_is_refused(dataset_s3, tmp_path: Path) -> None:
    state = _state_after(_dataset(tmp_path / "cache"), 4)
    other = ResumableDataset(
        f"s3://{BUCKET}/train-{{000000..000004}}.tar",
        seed=11,
        cache=ShardCache(tmp_path / "cache"),
        rank=0,
        world_size=1,
    )
    with pytest.raises(ResumeError, match="another shard list \\(6 shards") as caught:
        other.load_state_dict(state)
    assert "this dataset's (5 shards" in str(caught.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(version=99), "version 99 cannot be read by this shardcache"),
        # Version 3 handed whole shards to caches by samples, not by count.
        (lambda s: s.update(version=3), r"version 3 cannot be read .* reads version 4"),
        (lambda s: s.update(format="other"), "not a shardcache resume state"),
    ],
)
def test_a_state_of_another_format_or_version_is_refused(
    dataset_s3, tmp_path: Path, edit, message: str
) -> None:
    state = _state_after(_dataset(tmp_path / "cache"), 4)
    edit(state)
    with pytest.raises(ResumeError, match=message):
        _dataset(tmp_path / "cache").load_state_dict(state)


def test_a_workers_state_in_another_slot_says_to_gather_a_job_state(
    dataset_s3, tmp_path: Path
) -> None:
    state = _state_after(_dataset(tmp_path / "cache", rank=0, world_size=2), 3)
    other = _dataset(tmp_path / "cache", rank=1, world_size=2)
    other.load_state_dict(state)
    with pytest.raises(ResumeError, match=r"shardcache\.job_state"):
        iter(other)


def test_set_epoch_refuses_to_skip_the_rest_of_a_loaded_epoch(dataset_s3, tmp_path: Path) -> None:
    state = _state_after(_dataset(tmp_path / "cache"), 4)
    dataset = _dataset(tmp_path / "cache")
    dataset.load_state_dict(state)
    with pytest.raises(ResumeError, match="rest of epoch 0 would be skipped"):
        dataset.set_epoch(1)
    dataset.set_epoch(0)  # the same epoch: resumes
    assert len(list(dataset)) == len(ALL_KEYS) - 4
    dataset.set_epoch(1)  # then the next one, from its start
    assert len(list(dataset)) == len(ALL_KEYS)


def test_with_workers_the_loaded_epoch_is_resumed_in_them_then_left(
    dataset_s3, tmp_path: Path
) -> None:
    """The main process's copy never iterates: set_epoch moves on after its epoch."""
    state = _state_after(_dataset(tmp_path / "cache"), 4)
    dataset = _dataset(tmp_path / "cache")
    dataset.load_state_dict(job_state(state))
    loader = _loader(dataset, workers=2)
    batches = _epochs(loader, dataset, range(2))
    assert len([k for e, ks in batches if e == 0 for k in ks]) == len(ALL_KEYS) - 4
    assert sorted(k for e, ks in batches if e == 1 for k in ks) == sorted(ALL_KEYS)


def test_job_state_refuses_states_of_different_epochs(dataset_s3, tmp_path: Path) -> None:
    first = _state_after(_dataset(tmp_path / "cache", rank=0, world_size=2), 2)
    later = _dataset(tmp_path / "cache", rank=1, world_size=2)
    later.set_epoch(1)
    with pytest.raises(ResumeError, match="different epochs \\(0 and 1\\)"):
        job_state([first, _state_after(later, 2)])


def test_a_shard_that_changed_since_the_state_is_refused(dataset_s3, tmp_path: Path, s3) -> None:
    state = _state_after(_dataset(tmp_path / "cache", shuffle_buffer=0), 3)
    # The shard being read: rewritten with other keys (the same sizes and offsets).
    shard = plan_for(_dataset(tmp_path / "cache")._epoch_split(), 0)(1, 1, 0)[state["item"]].shard
    changed = [(f"x{key}", files) for key, files in shard_samples(shard, PER_SHARD)]
    s3.put_objects(BUCKET, {f"train-{shard:06d}.tar": tar_bytes(changed)})
    dataset = _dataset(tmp_path / "fresh", shuffle_buffer=0)
    dataset.load_state_dict(state)
    with pytest.raises(ResumeError, match="changed since the resume state was taken"):
        list(dataset)


def test_a_cold_resume_reads_buffered_samples_of_finished_shards_by_ranged_requests(
    dataset_s3, tmp_path: Path, s3
) -> None:
    """Buffered samples whose shard is not read again this epoch cost one ranged GET each
    (no HEAD, nothing cached), not a whole shard."""
    urls = shardcache.expand_urls(SPEC)
    index = str(tmp_path / "train.index.json")
    write_index(index, index_document(learn(urls, ShardCache(tmp_path / "c"), threads=2), urls))
    reference = [s["__key__"] for s in _dataset(tmp_path / "c", shuffle_buffer=8, index=index)]
    state = _state_after(_dataset(tmp_path / "c", shuffle_buffer=8, index=index), 50)
    plan = plan_for(_dataset(tmp_path / "c")._epoch_split(), 0)(1, 1, 0)
    left = {piece.shard for piece in plan[state["item"] :]}
    buffered = Counter(shard for shard, _offset, _key in state["buffer"])
    finished = {shard: n for shard, n in buffered.items() if shard not in left}
    assert finished, "the checkpoint must hold samples of a finished shard"
    s3.clear_requests()
    resumed = _dataset(tmp_path / "cold", shuffle_buffer=8, index=index)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert reference[:50] + [s["__key__"] for s in resumed] == reference
    for shard, n in finished.items():
        key = f"train-{shard:06d}.tar"
        assert (s3.count("HEAD", BUCKET, key), s3.count("GET", BUCKET, key)) == (0, n), shard
        assert not ShardCache(tmp_path / "cold").contains(urls[shard])
    for shard in left:  # the rest is read through the cache
        assert s3.count("GET", BUCKET, f"train-{shard:06d}.tar") >= 1


def test_a_shard_that_no_longer_matches_its_index_file_is_refused(
    dataset_s3, tmp_path: Path, s3
) -> None:
    urls = shardcache.expand_urls(SPEC)
    index = str(tmp_path / "train.index.json")
    write_index(index, index_document(learn(urls, ShardCache(tmp_path / "c"), threads=2), urls))
    s3.put_objects(BUCKET, {"train-000002.tar": tar_bytes(shard_samples(2, PER_SHARD - 4))})
    dataset = _dataset(tmp_path / "fresh", shuffle_buffer=0, index=index)
    with pytest.raises(SampleIndexError, match=r"train-000002\.tar does not match its sample"):
        list(dataset)
    learned = _dataset(tmp_path / "fresh", shuffle_buffer=0)  # no index file: learned afresh
    assert len(list(learned)) == SHARDS * PER_SHARD - 4


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"remainder": "even"}, "remainder must be one of"),
        ({"index": 3}, "index must be a path or URL"),
        ({"shuffle_buffer": -1}, "shuffle_buffer must be a whole number >= 0"),
        ({"seed": 1.5}, "seed must be a whole number"),
        ({"epoch_size": 0}, "epoch_size must be a whole number >= 1"),
        ({"epoch_size": True}, "epoch_size must be a whole number >= 1"),
        ({"rank": 2, "world_size": 2}, "rank 2 is not below world_size 2"),
        ({"rank": None, "world_size": 2}, "give both rank and world_size"),
        ({"shuffle_scope": "node"}, "shuffle_scope must be one of"),
        ({"shuffle_scope": "global", "shuffle_shards": False}, "shuffle_shards=True only"),
    ],
)
def test_bad_arguments_are_config_errors(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _dataset(tmp_path / "cache", **options)


def test_persistent_workers_are_refused_as_they_would_repeat_an_epoch(
    dataset_s3, tmp_path: Path
) -> None:
    dataset = _dataset(tmp_path / "cache")
    loader = DataLoader(
        dataset, batch_size=3, num_workers=1, persistent_workers=True, collate_fn=keys_of
    )
    dataset.set_epoch(0)
    assert sorted(k for ks in loader for k in ks) == sorted(ALL_KEYS)
    dataset.set_epoch(1)
    with pytest.raises(ConfigError, match="persistent_workers=False"):
        list(loader)


def test_standard_input_cannot_be_resumed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read standard input"):
        ResumableDataset(["-"], cache=ShardCache(tmp_path))


def test_public_names() -> None:
    assert shardcache.ResumableDataset is ResumableDataset
    assert ResumableDataset.__module__ == "shardcache"


# ------------------------------------------------------------------ handler
def _local_shards(root: Path, broken: dict[int, bytes | None]) -> list[str]:
    """Local shards; ``broken[i]`` replaces shard i's bytes (None: the file is missing)."""
    urls = []
    for shard in range(SHARDS):
        path = root / f"local-{shard}.tar"
        data = broken.get(shard, tar_bytes(shard_samples(shard, PER_SHARD)))
        if data is not None:
            path.write_bytes(data)
        urls.append(str(path))
    return urls


@pytest.mark.parametrize(
    ("broken", "error"),
    [(None, shardcache.RemoteNotFoundError), (b"not a tar" * 100, shardcache.ShardFormatError)],
)
def test_a_shard_the_handler_skips_is_passed_over_and_the_state_stays_exact(
    tmp_path: Path, broken: bytes | None, error: type
) -> None:
    urls = _local_shards(tmp_path, {2: broken})
    seen: list[BaseException] = []

    def handler(exn: BaseException) -> bool:
        seen.append(exn)
        return True

    def dataset() -> ResumableDataset:
        return ResumableDataset(
            urls,
            seed=3,
            handler=handler,
            cache=ShardCache(tmp_path / "cache"),
            rank=0,
            world_size=1,
        )

    full = [s["__key__"] for s in dataset()]
    assert sorted(full) == sorted(k for k in ALL_KEYS if not k.startswith("s0002_"))
    assert [type(e) for e in seen] == [error]
    for count in (5, 30, 60):
        first = dataset()
        state = _state_after(first, count)
        resumed = dataset()
        resumed.load_state_dict(json.loads(json.dumps(state)))
        assert full[:count] + [s["__key__"] for s in resumed] == full


def test_without_a_handler_a_bad_shard_raises_where_it_is(tmp_path: Path) -> None:
    urls = _local_shards(tmp_path, {0: b"\0" * 100 + b"x" * 1000})
    dataset = ResumableDataset(
        urls, shuffle_shards=False, cache=ShardCache(tmp_path / "cache"), rank=0, world_size=1
    )
    with pytest.raises(shardcache.ShardFormatError, match=r"local-0\.tar: the shard starts b"):
        list(dataset)


def test_the_loader_report_counts_each_epoch_of_the_resumable_dataset(
    dataset_s3, tmp_path: Path
) -> None:
    """Two epochs through 2 workers: each epoch's report (the workers' totals, handed to
    the training process) has every sample and shard once, downloads first, hits after."""
    dataset = _dataset(tmp_path / "cache")
    loader = _loader(dataset)
    reports = []
    for epoch in range(2):
        dataset.set_epoch(epoch)
        assert sum(len(keys) for keys in loader) == SHARDS * PER_SHARD
        reports.append(shardcache.log_epoch_summary(epoch))
    assert [r["samples"] for r in reports] == [SHARDS * PER_SHARD] * 2
    assert [r["epoch"] for r in reports] == [0, 1]
    # Epoch 0 learns the sample offsets first (downloading every shard), then reads.
    assert [(r["misses"], r["hits"]) for r in reports] == [(SHARDS, SHARDS), (0, SHARDS)]
