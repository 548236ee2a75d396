"""What an epoch split's pieces cover, for the pure split tests: fake sample offsets and
the (shard, sample index) of every sample a consumer's pieces deliver."""

from __future__ import annotations

from shardcache._datasets.epoch_split import EpochSplit
from shardcache._datasets.resume_plan import Piece


def starts_of(counts: list[int]) -> list[list[int]]:
    """Fake sample offsets: sample i of a shard starts at byte 1024 * i."""
    return [[1024 * i for i in range(n)] for n in counts]


def delivered(split: EpochSplit, pieces: list[Piece]) -> list[tuple[int, int]]:
    """(shard, sample index) of every sample the pieces cover, in order."""
    out = []
    for piece in pieces:
        run = split.run_of(piece)
        out += [(run.shard, i) for i in range(run.first, run.stop)]
    return out
