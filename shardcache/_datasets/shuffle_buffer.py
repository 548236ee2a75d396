"""The resumable dataset's seeded shuffle buffer, and reading its samples again on resume:
from an opened shard, or, for a shard not read again in the epoch, by ranged requests of
just those samples' bytes (:func:`restore_ranged`)."""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import io
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from .._base.errors import ResumeError
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .resume_plan import RandomDraws
from .resume_state import Progress
from .sample_index import SampleIndex
from .tar_members import samples

logger = get_logger(__name__)

# A shard whose buffered samples are restored by ranged reads has at most this many of
# them (one request each); more, and the whole shard is fetched instead.
RANGED_RESTORE_MAX = 16


class ShuffleBuffer:
    """The seeded shuffle buffer, its positions mirrored in ``progress.buffer``: a full
    buffer hands out a random held sample for each new one; the end drains it randomly.
    ``source`` tags the samples read again (a mixture source's name)."""

    def __init__(self, progress: Progress, draws: RandomDraws, source: str | None = None) -> None:
        self._progress = progress
        self._draws = draws
        self._source = source
        # Samples of a restored state are read again; None until their shard is opened.
        self._held: list[dict[str, Any] | None] = [None] * len(progress.buffer)
        self.out: tuple[int, int, str] | None = None  # the position of the last sample out

    def restore(
        self,
        url: str,
        local_path: str | None,
        indices: Sequence[int],
        stream_at: Callable[[int], BinaryIO],
    ) -> None:
        """Read the buffered samples ``indices`` of ``url`` again (``stream_at(offset)``: a
        stream positioned at a sample's first byte)."""
        for index in sorted(indices, key=lambda i: self._progress.buffer[i][1]):
            _shard, offset, key = self._progress.buffer[index]
            sample = next(samples(stream_at(offset), offset, url, only_one=True), None)
            if sample is None or sample.key != key:
                raise changed(url, offset, key, None if sample is None else sample.key)
            self._held[index] = sample.as_dict(url, local_path, self._source)

    def drop_unrestored(self) -> list[tuple[int, int, str]]:
        """Buffered samples whose shard the handler skipped are lost, as in webdataset;
        returns their positions."""
        if None not in self._held:
            return []
        keep = [i for i, sample in enumerate(self._held) if sample is not None]
        logger.warning(
            "%d buffered samples were lost with their shards", len(self._held) - len(keep)
        )
        lost = [p for i, p in enumerate(self._progress.buffer) if self._held[i] is None]
        self._held = [self._held[i] for i in keep]
        self._progress.buffer = [self._progress.buffer[i] for i in keep]
        return lost

    def add(self, item: dict[str, Any]) -> dict[str, Any] | None:
        progress = self._progress
        if progress.buffer_size == 0:
            self.out = item["position"]
            return item["sample"]
        if len(self._held) < progress.buffer_size:
            self._held.append(item["sample"])
            progress.buffer.append(item["position"])
            return None
        index = self._draws.below(progress.buffer_size)
        out = self._held[index]
        self.out = progress.buffer[index]
        self._held[index] = item["sample"]
        progress.buffer[index] = item["position"]
        progress.draws = self._draws.draws
        return out

    def drain_one(self) -> dict[str, Any] | None:
        if not self._held:
            return None
        index, last = self._draws.below(len(self._held)), len(self._held) - 1
        held, positions = self._held, self._progress.buffer
        held[index], held[last] = held[last], held[index]
        positions[index], positions[last] = positions[last], positions[index]
        self.out = positions.pop()
        self._progress.draws = self._draws.draws
        return held.pop()


def restore_ranged(  # noqa: PLR0917
    progress: Progress,
    shuffler: ShuffleBuffer,
    urls: Sequence[str],
    index: SampleIndex,
    cache: ShardCache,
    threads: int | None,
) -> set[int]:
    """Buffered samples of shards that are neither cached nor read again this epoch are
    read by ranged requests of their own bytes instead of whole shards (a cold resume);
    returns those shards."""
    pending = {p.shard for p in progress.plan[progress.item :]}
    wanted = {
        shard: indices
        for shard, indices in buffered_by_shard(progress).items()
        if shard not in pending
        and len(indices) <= RANGED_RESTORE_MAX
        and not cache.contains(urls[shard])
    }
    if not wanted:
        return set()

    def restore(shard: int) -> None:
        url = urls[shard]
        record = index[url]

        def read(offset: int) -> BinaryIO:
            after = bisect.bisect_right(record.starts, offset)
            end = record.starts[after] if after < record.count else record.size
            return io.BytesIO(cache.remote.read_range(url, offset, end, record.etag))

        shuffler.restore(url, None, wanted[shard], read)

    with cf.ThreadPoolExecutor(max_workers=threads or cache.settings.threads) as pool:
        for done in [pool.submit(restore, shard) for shard in wanted]:
            done.result()
    logger.info(
        "restored %d buffered samples of %d shards by ranged reads",
        sum(len(i) for i in wanted.values()),
        len(wanted),
    )
    return set(wanted)


def buffered_by_shard(progress: Progress) -> dict[int, list[int]]:
    """The buffered samples' indices in ``progress.buffer``, by shard, in buffer order."""
    by_shard: dict[int, list[int]] = {}
    for index, (shard, _offset, _key) in enumerate(progress.buffer):
        by_shard.setdefault(shard, []).append(index)
    return by_shard


def seeked(stream: BinaryIO, offset: int) -> BinaryIO:
    stream.seek(offset)
    return stream


def changed(url: str, offset: int, expected: str, seen: str | None) -> ResumeError:
    return ResumeError(
        f"{url} changed since the resume state was taken: at byte {offset} the state expects "
        f"sample {expected!r}, the shard has {seen!r} there. Resume over the shards as they "
        "were, or start the epoch again (set_epoch without loading the state)",
        url=url,
        offset=offset,
        expected=expected,
        seen=seen,
    )
