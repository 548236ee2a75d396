"""Local shards for the mixture property tests: sources of unique keys, each source's
sample index made once (not by every dataset an example builds), and what reads their
streams: the (source, key) pairs and the global batches of a DDP job."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from tars import shard_samples, tar_bytes

from shardcache import ShardCache, Step
from shardcache._datasets.sample_index import index_document, learn, write_index

Pair = tuple[str, str]  # (source, key)


class MixtureFiles:
    """``shard_counts[i]`` are the sample counts of source ``m{i}``'s shards, written under
    ``root``: ``parts`` gives each source's (name, urls, index file), ``keys`` its keys."""

    def __init__(self, root: Path, shard_counts: Sequence[Sequence[int]]) -> None:
        self.cache = ShardCache(root / "cache")
        self.keys: dict[str, set[str]] = {}
        self.parts: list[tuple[str, list[str], str]] = []
        shard = 0
        for i, counts in enumerate(shard_counts):
            name, urls = f"m{i}", []
            self.keys[name] = set()
            for count in counts:
                path = root / f"{shard:04d}.tar"
                path.write_bytes(tar_bytes(shard_samples(shard, count, size=8)))
                urls.append(str(path))
                self.keys[name] |= {key for key, _ in shard_samples(shard, count)}
                shard += 1
            index = str(root / f"{name}.index.json")
            write_index(index, index_document(learn(urls, self.cache, threads=1), urls))
            self.parts.append((name, urls, index))


def pairs(samples: Iterable[dict[str, Any]]) -> list[Pair]:
    return [(s["__source__"], s["__key__"]) for s in samples]


def global_batches(
    runs: Sequence[Sequence[Any]], ranks: int, workers: int, batch: int
) -> list[list]:
    """The global batches of a DataLoader per rank (its workers' batches in turn) under
    DDP (a step's batches of every rank); every rank must yield the same number."""
    steps = []
    for rank in range(ranks):
        own = [
            [run[i : i + batch] for i in range(0, len(run), batch)]
            for run in runs[rank * workers : (rank + 1) * workers]
        ]
        assert len({len(batches) for batches in own}) == 1
        steps.append([own[s % workers][s // workers] for s in range(len(own[0]) * workers)])
    assert len({len(s) for s in steps}) == 1
    return [[p for rank in steps for p in rank[t]] for t in range(len(steps[0]))]


@st.composite
def weights_of(draw: st.DrawFn, k: int) -> dict[str, int]:
    """Weights 0-3 of sources ``m0`` .. ``m{k-1}``, at least one above 0."""
    weights = draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
    if not any(weights):
        weights[draw(st.integers(0, k - 1))] = 1
    return {f"m{i}": w for i, w in enumerate(weights)}


@st.composite
def schedule_entries(draw: st.DrawFn, k: int, epoch_size: int, epochs: int) -> list:
    """A schedule of ``epochs`` entries for sources ``m0`` .. ``m{k-1}``: each the weights
    of the whole epoch or 1-3 ``Step`` s at random samples."""
    entries: list = []
    for _ in range(epochs):
        if draw(st.booleans()):
            entries.append(draw(weights_of(k)))
        else:
            ats = sorted(set(draw(st.lists(st.integers(1, epoch_size - 1), max_size=2))))
            entries.append([Step(at, draw(weights_of(k))) for at in [0, *ats]])
    return entries
