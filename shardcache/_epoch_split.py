"""The sample-level split of an epoch: every consumer the same number of samples, each
shard read by the same cache in every epoch.

*Consumers* are rank x DataLoader worker (slot ``rank * workers + worker``), grouped into
*units* that share a cache: a rank's workers (rank scope) or a node's ranks and workers
(node scope, ranks numbered contiguously per node). With ``J`` consumers and ``T``
samples, each consumer gets ``N = ceil(T / J)`` samples (``remainder="pad"``, the
``J * N - T`` missing ones repeat samples of the epoch) or ``floor(T / J)`` (``"drop"``:
``T - J * N`` samples are left out of the epoch), so every rank yields the same number
of batches whatever the batch size.

Stable across epochs (what keeps later epochs in the cache): the shards, in an order drawn
from the seed alone, are laid end to end as one sequence of samples, and unit ``u`` of
``U`` owns the samples ``[u*T//U, (u+1)*T//U)`` of it: whole shards, and at most one
partial shard at each end (read by both neighbours). Changing with the epoch: the order
of the unit's shards (drawn from seed and epoch), which of its samples repeat or are
dropped (the ends of that order), and so which consumer reads what. A unit that owns no
sample at all (fewer samples than units) repeats samples of the whole sequence.

An elastic resume splits the samples left undelivered the same way, in the order they
were left (so a consumer's leftover mostly goes to the consumer in its place).

Everything here is a pure function of its arguments: every rank computes the same split.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

from ._errors import ConfigError, SampleIndexError
from ._resume_plan import Piece, epoch_order

REMAINDERS = ("pad", "drop")


@dataclass(frozen=True)
class Run:
    """Samples ``first`` .. ``stop - 1`` of shard ``shard`` (indices in the shard)."""

    shard: int
    first: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.first


@dataclass(frozen=True)
class Share:
    """What one consumer reads in an epoch, and how many of its samples are repeats."""

    pieces: list[Piece]
    samples: int
    repeated: int


class EpochSplit:
    """The split of a shard list whose sample offsets are ``starts[shard]``."""

    def __init__(
        self,
        starts: Sequence[Sequence[int]],
        *,
        seed: int,
        shuffle: bool,
        remainder: str,
    ) -> None:
        if remainder not in REMAINDERS:
            raise ConfigError(
                f"remainder must be one of {REMAINDERS}, not {remainder!r}: 'pad' repeats "
                "samples so that every consumer gets ceil(samples / consumers), 'drop' leaves "
                "the rest out of the epoch",
                name="remainder",
                value=remainder,
            )
        self.starts = starts
        self.seed, self.shuffle, self.remainder = seed, shuffle, remainder
        self.counts = [len(s) for s in starts]
        self.total = sum(self.counts)
        if self.total == 0:
            raise SampleIndexError(
                f"the {len(starts)} shards hold no sample at all: there is nothing to train "
                "on (check the shard list, or the shards' member names: a sample is members "
                "sharing a key, name.suffix)",
                shards=len(starts),
            )
        order = epoch_order(len(starts), seed, -1, shuffle=shuffle)  # -1: not an epoch's
        self._base = [Run(s, 0, self.counts[s]) for s in order if self.counts[s] > 0]
        self._ends = list(accumulate(len(r) for r in self._base))
        self.digest = hashlib.blake2b(
            repr(self.counts).encode(), digest_size=12
        ).hexdigest()  # the sample layout a state was taken with

    # -- sizes ----------------------------------------------------------------------

    def per_consumer(self, samples: int, consumers: int) -> int:
        """Samples each of ``consumers`` gets out of ``samples``."""
        if self.remainder == "pad":
            return -(-samples // consumers)
        return samples // consumers

    def totals(self, consumers: int) -> dict[str, int]:
        """The fresh epoch's sizes for a job of ``consumers``: samples in the shards,
        per consumer, repeated and dropped (job-wide)."""
        each = self.per_consumer(self.total, consumers)
        if self.remainder == "drop" and each == 0:
            raise ConfigError(
                f"remainder='drop' with {consumers} consumers (ranks x DataLoader workers) "
                f"and {self.total} samples: every sample would be dropped; use "
                "remainder='pad' (samples repeat) or fewer ranks or workers",
                name="remainder",
                value="drop",
            )
        return {
            "samples": self.total,
            "per_consumer": each,
            "repeated": max(0, each * consumers - self.total),
            "dropped": max(0, self.total - each * consumers),
        }

    # -- plans ----------------------------------------------------------------------

    def fresh(self, epoch: int, consumers: int, per_unit: int, slot: int) -> Share:
        """Consumer ``slot``'s share of a fresh epoch; consumers ``per_unit`` at a time share
        a cache (``consumers`` is a multiple of ``per_unit``)."""
        each = self.totals(consumers)["per_consumer"]
        units = consumers // per_unit
        unit, k = divmod(slot, per_unit)
        first, last = unit * self.total // units, (unit + 1) * self.total // units
        if last > first:
            runs = self._runs_between(first, last)
            if self.shuffle:
                runs.sort(key=lambda r: _digest(self.seed, epoch, r.shard))
            start, owned = k * each, last - first
        else:  # fewer samples than units: this unit repeats samples of the whole sequence
            runs, start, owned = list(self._base), unit * per_unit * each + k * each, 0
        repeated = max(0, start + each - max(owned, start))
        return Share(self._pieces(_take(runs, start, each)), each, repeated)

    def share(self, left: Sequence[Piece], consumers: int, slot: int) -> Share:
        """Consumer ``slot``'s equal part of an elastic resume's undelivered pieces."""
        runs = [self.run_of(piece) for piece in left]
        samples = sum(len(r) for r in runs)
        each = self.per_consumer(samples, consumers) if samples else 0
        start = slot * each
        repeated = max(0, start + each - max(samples, start))
        return Share(self._pieces(_take(runs, start, each)), each, repeated)

    def shard_units(self, units: int) -> list[list[int]]:
        """The shards each of ``units`` reads in every epoch (for warming; a unit that owns
        no sample reads from every shard)."""
        owned: list[list[int]] = []
        for unit in range(units):
            first, last = unit * self.total // units, (unit + 1) * self.total // units
            runs = self._runs_between(first, last) if last > first else self._base
            owned.append(sorted({r.shard for r in runs}))
        return owned

    # -- runs and pieces ----------------------------------------------------------------

    def run_of(self, piece: Piece) -> Run:
        """The samples a piece covers, by index."""
        starts = self.starts[piece.shard]
        first = bisect.bisect_left(starts, piece.start)
        if first >= len(starts) or starts[first] != piece.start:
            raise SampleIndexError(
                f"shard {piece.shard} has no sample starting at byte {piece.start} in its "
                "sample index: the state and the index describe different shards. Resume "
                "with the index the state was taken with",
                shard=piece.shard,
                offset=piece.start,
            )
        stop = len(starts) if piece.count is None else first + piece.count
        return Run(piece.shard, first, min(stop, len(starts)))

    def _runs_between(self, first: int, last: int) -> list[Run]:
        """The base sequence's samples ``first`` .. ``last - 1`` as runs."""
        runs = []
        index = bisect.bisect_right(self._ends, first)
        while index < len(self._base):
            run = self._base[index]
            begin = self._ends[index] - len(run)
            if begin >= last:
                break
            lo, hi = max(first - begin, 0), min(last - begin, len(run))
            runs.append(Run(run.shard, run.first + lo, run.first + hi))
            index += 1
        return runs

    def _pieces(self, runs: Iterator[Run]) -> list[Piece]:
        return [Piece(r.shard, self.starts[r.shard][r.first], len(r)) for r in runs]


def _take(runs: Sequence[Run], start: int, count: int) -> Iterator[Run]:
    """``count`` samples of the endless repetition of ``runs``, from sample ``start``;
    neighbouring pieces of one run are joined."""
    total = sum(len(r) for r in runs)
    if count <= 0 or total == 0:
        return
    ends = list(accumulate(len(r) for r in runs))
    position = start % total
    pending: Run | None = None
    while count > 0:
        index = bisect.bisect_right(ends, position)
        run = runs[index]
        lo = position - (ends[index] - len(run))
        size = min(count, len(run) - lo)
        piece = Run(run.shard, run.first + lo, run.first + lo + size)
        if pending is not None and (pending.shard, pending.stop) == (piece.shard, piece.first):
            pending = Run(pending.shard, pending.first, piece.stop)
        else:
            if pending is not None:
                yield pending
            pending = piece
        count -= size
        position = (position + size) % total
    if pending is not None:
        yield pending


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=16).digest()
