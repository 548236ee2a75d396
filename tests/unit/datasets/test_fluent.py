"""ResumableDataset's and MixtureDataset's ``len()`` (this rank's samples an epoch, with
its DataLoader workers) and fluent stages (resume exact through ``.batched()``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import webdataset as wds
from tars import shard_samples, tar_bytes
from torchdata.stateful_dataloader import StatefulDataLoader

from shardcache import ConfigError, MixtureDataset, ResumableDataset, ShardCache, Source

pytestmark = pytest.mark.timeout(120)
COUNTS = (12, 9, 11, 5)  # 37 samples: no consumer count below divides them


@pytest.fixture
def urls(tmp_path: Path) -> list[str]:
    made = []
    for shard, count in enumerate(COUNTS):
        path = tmp_path / f"{shard:04d}.tar"
        path.write_bytes(tar_bytes(shard_samples(shard, count, size=8)))
        made.append(str(path))
    return made


def dataset(tmp_path: Path, urls: list[str], rank: int = 0, world: int = 1, **options):
    return ResumableDataset(
        urls,
        cache=ShardCache(tmp_path / "cache"),
        threads=1,
        rank=rank,
        world_size=world,
        **options,
    )


def loaded(data, workers: int) -> int:
    loader = StatefulDataLoader(
        data, batch_size=None, num_workers=workers, collate_fn=lambda s: s, timeout=60
    )
    return sum(1 for _ in loader)


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_len_is_the_samples_each_rank_yields_an_epoch(
    tmp_path: Path, urls: list[str], remainder: str
) -> None:
    per_rank = {"pad": 19, "drop": 18}[remainder]  # 37 over 2 ranks: ceil or floor
    for rank in (0, 1):
        data = dataset(tmp_path, urls, rank, 2, remainder=remainder)
        assert len(data) == per_rank
        assert sum(1 for _ in data) == per_rank


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_len_counts_the_dataloader_workers_given_to_prepare(
    tmp_path: Path, urls: list[str], remainder: str
) -> None:
    # 2 ranks x 2 workers: 4 consumers of 10 (pad) or 9 (drop) samples each.
    per_rank = {"pad": 20, "drop": 18}[remainder]
    for rank in (0, 1):
        data = dataset(tmp_path, urls, rank, 2, remainder=remainder).prepare(workers=2)
        assert len(data) == per_rank
        assert loaded(data, 2) == per_rank
    data = dataset(tmp_path, urls, 0, 2, remainder="pad")
    assert len(data) == 19  # without prepare(workers=): one consumer per rank
    assert len(data.prepare(workers=0)) == 19  # num_workers=0: the rank reads
    assert len(data.prepare(workers=3)) == 21  # 6 consumers of 7


def test_len_is_the_epoch_size_share_and_stays_after_a_state_is_loaded(
    tmp_path: Path, urls: list[str]
) -> None:
    data = dataset(tmp_path, urls, 1, 2, epoch_size=30, seed=3)
    assert len(data) == 15
    stream = iter(data)
    for _ in range(4):
        next(stream)
    state = data.state_dict()
    again = dataset(tmp_path, urls, 1, 2, epoch_size=30, seed=3)
    again.load_state_dict(state)
    assert len(again) == 15  # the whole epoch's count, not what remains
    assert sum(1 for _ in again) == 11


def test_mixture_len_is_its_sources_samples_for_this_rank(tmp_path: Path, urls: list[str]) -> None:
    def mixture(rank: int) -> MixtureDataset:
        return MixtureDataset(
            [Source(urls[:2], weight=0.6, name="a"), Source(urls[2:], weight=0.4, name="b")],
            epoch_size=41,
            cache=ShardCache(tmp_path / "cache"),
            threads=1,
            rank=rank,
            world_size=2,
        )

    for rank in (0, 1):
        assert len(mixture(rank)) == sum(1 for _ in mixture(rank)) == 21  # ceil(41 / 2)
        prepared = mixture(rank).prepare(workers=2)
        assert len(prepared) == loaded(prepared, 2) == 22  # 4 consumers of 11


def test_fluent_stages_run_on_the_samples(tmp_path: Path, urls: list[str]) -> None:
    out = list(
        dataset(tmp_path, urls, seed=5)
        .decode()
        .rename(label="cls")
        .to_tuple("__key__", "label")
        .map(lambda pair: (pair[0], pair[1] + 100))
        .select(lambda pair: pair[1] != 100)
    )
    every = list(
        dataset(tmp_path, urls, seed=5).compose(wds.decode(), wds.to_tuple("__key__", "cls"))
    )
    assert isinstance(every[0][1], int)
    assert out == [(key, label + 100) for key, label in every if label != 0]
    assert 0 < len(out) < len(every)


@pytest.mark.parametrize("partial", [True, False])
def test_resume_after_batched_batches_is_exact(
    tmp_path: Path, urls: list[str], partial: bool
) -> None:
    def keys(batches) -> list[str]:
        return [key for batch in batches for key in batch[0]]

    def make():
        return (
            dataset(tmp_path, urls, shuffle_buffer=6, seed=2)
            .to_tuple("__key__", "cls")
            .batched(4, partial=partial)
        )

    whole = keys(make())
    assert len(whole) == (37 if partial else 36)
    loader = StatefulDataLoader(make(), batch_size=None, num_workers=0)
    stream = iter(loader)
    first = keys([next(stream) for _ in range(3)])
    state = loader.state_dict()
    resumed = StatefulDataLoader(make(), batch_size=None, num_workers=0)
    resumed.load_state_dict(state)
    rest = keys(resumed)
    assert first + rest == whole  # wds.batched reads one sample ahead: one would be lost


def test_resume_after_batched_batches_in_workers_is_exact(tmp_path: Path, urls: list[str]) -> None:
    def make():
        return dataset(tmp_path, urls).to_tuple("__key__").batched(3, collation_fn=None)

    def run(loader) -> list[str]:
        return [key for batch in loader for (key,) in batch]

    whole = sorted(run(StatefulDataLoader(make(), batch_size=None, num_workers=2)))
    loader = StatefulDataLoader(make(), batch_size=None, num_workers=2, timeout=60)
    stream = iter(loader)
    first = [key for _ in range(4) for (key,) in next(stream)]
    state = loader.state_dict()
    resumed = StatefulDataLoader(make(), batch_size=None, num_workers=2, timeout=60)
    resumed.load_state_dict(state)
    assert sorted(first + run(resumed)) == whole


def test_batched_checks_its_size(tmp_path: Path, urls: list[str]) -> None:
    with pytest.raises(ConfigError, match="batchsize"):
        dataset(tmp_path, urls).batched(0)


def test_mixture_resume_after_batched_batches_is_exact(tmp_path: Path, urls: list[str]) -> None:
    def make() -> MixtureDataset:
        sources = [Source(urls[:3], weight=0.5, name="a"), Source(urls[3:], weight=0.5, name="b")]
        mixture = MixtureDataset(
            sources, epoch_size=30, seed=1, cache=ShardCache(tmp_path / "cache"), threads=1
        )
        return mixture.to_tuple("__source__", "__key__").batched(4, collation_fn=None)

    whole = [pair for batch in make() for pair in batch]
    assert len(whole) == 30 and {source for source, _ in whole} == {"a", "b"}
    loader = StatefulDataLoader(make(), batch_size=None, num_workers=0)
    stream = iter(loader)
    first = [tuple(pair) for _ in range(3) for pair in next(stream)]  # the loader makes lists
    resumed = StatefulDataLoader(make(), batch_size=None, num_workers=0)
    resumed.load_state_dict(loader.state_dict())
    assert first + [tuple(pair) for batch in resumed for pair in batch] == whole
