"""Reading a consumer's plan piece by piece: which shards to open, in order, and the samples
of one piece from the saved offset.

Invariant: the position (piece, byte offset, key of the next sample) moves past a sample
before the sample is handed on, so a state taken at any yield resumes right after the last
sample that left; a sample found at the offset with another key than recorded, or a shard
that ends before its piece's count, is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .epoch_split import EpochSplit
from .resume_plan import Piece
from .resume_state import Progress
from .sample_index import SampleIndex, check_sample, stale
from .shuffle_buffer import buffered_by_shard, changed
from .tar_members import samples


def visits(urls: list[str], progress: Progress, skip: set[int]) -> Iterator[dict[str, Any]]:
    """Shards to open, in order: those of buffered samples (once each, but ``skip``),
    then those of the pieces left."""
    for shard, indices in buffered_by_shard(progress).items():
        if shard not in skip:
            yield {"url": urls[shard], "visit": ("buffer", indices)}
    for item in range(progress.item, len(progress.plan)):
        yield {"url": urls[progress.plan[item].shard], "visit": ("piece", item)}


def piece_samples(
    progress: Progress,
    opened: Mapping[str, Any],
    sample_index: SampleIndex | None,
    split: EpochSplit,
    source: str | None = None,
) -> Iterator[dict[str, Any]]:
    """The samples of the piece being read, from ``progress.offset``; the position moves
    past each sample before it is handed on. Each is checked against ``sample_index``
    (the shards' sample offsets), when known, and tagged with ``source`` (a mixture
    source's name), if given."""

    item = progress.item
    piece = progress.plan[item]
    stream, url, local_path = opened["stream"], opened["url"], opened.get("local_path")
    stream.seek(progress.offset)
    expected = progress.key
    starts = sample_index[url].starts if sample_index is not None else None
    index = None if starts is None else split.run_of(Piece(piece.shard, progress.offset)).first
    for sample in samples(stream, progress.offset, url, only_one=piece.count == 1):
        if expected is not None and sample.key != expected:
            raise changed(url, sample.offset, expected, sample.key)
        expected = None
        progress.taken += 1
        if starts is not None and index is not None:
            check_sample(url, starts, index, sample)
            index += 1
        if sample.end < 0 or (piece.count is not None and progress.taken >= piece.count):
            advance(progress, item + 1)
        else:
            progress.offset, progress.key = sample.end, sample.next_key
        yield {
            "position": (piece.shard, sample.offset, sample.key),
            "sample": sample.as_dict(url, local_path, source),
        }
        if progress.item != item:  # the piece is done (the shard may go on)
            return
    if progress.item == item and piece.count is not None:  # the shard ended too soon
        raise stale(url, f"{piece.count} samples from byte {piece.start}", progress.taken)


def advance(progress: Progress, item: int) -> None:
    """Move ``progress`` to the start of piece ``item`` (past the last: the plan is done)."""
    progress.item = item
    progress.offset = progress.plan[item].start if item < len(progress.plan) else 0
    progress.key = None
    progress.taken = 0


__all__ = ["advance", "piece_samples", "visits"]
