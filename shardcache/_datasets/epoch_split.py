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
from the seed alone, are handed out to the units by :func:`~shardcache._datasets.cache_shares.
cache_shares` (whole shards by count, nested by unit count so that another unit count moves
few of them, then evened out to equal sample counts). The whole shards need no sample
count (:func:`indexing_shares`): each unit learns the offsets of its own only. Changing
with the epoch: the order of the unit's shards (drawn from seed and epoch), which of its
samples repeat or are dropped (the ends of that order), and so which consumer reads what.
A unit that owns no sample at all (fewer samples than units) repeats samples of the whole
sequence.

An elastic resume hands the samples left undelivered to the units owning their shards in
the new layout, evened out the same way, then deals each unit's part to its consumers.

Everything here is a pure function of its arguments: every rank computes the same split.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate

from .._base.errors import ConfigError, SampleIndexError
from .cache_shares import Run, cache_shares, even_out, owners, quotas, whole_shards
from .resume_plan import Piece, epoch_order

REMAINDERS = ("pad", "drop")


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
        epoch_size: int | None = None,
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
        self.epoch_size = epoch_size  # None: the shards' samples
        self.counts = [len(s) for s in starts]
        self.total = sum(self.counts)
        if self.total == 0:
            raise SampleIndexError(
                f"the {len(starts)} shards hold no sample at all: there is nothing to train "
                "on (check the shard list, or the shards' member names: a sample is members "
                "sharing a key, name.suffix)",
                shards=len(starts),
            )
        self._order = _stable_order(len(starts), seed, shuffle)
        order = self._order
        self._base = [Run(s, 0, self.counts[s]) for s in order if self.counts[s] > 0]
        self._shares: dict[int, list[list[Run]]] = {}
        self._last_order: tuple[tuple[int, ...] | None, list[Run]] = (None, [])
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
        """The fresh epoch's sizes for a job of ``consumers``: samples in the shards, the
        epoch size asked for, per consumer, repeated and dropped (job-wide; with an epoch
        size below the samples, "dropped" ones come first in the next epochs)."""
        wanted = self.total if self.epoch_size is None else self.epoch_size
        if self.epoch_size is not None and self.epoch_size < consumers:
            raise ConfigError(
                f"epoch_size={self.epoch_size} is smaller than the job's {consumers} "
                "consumers (ranks x DataLoader workers): each must yield at least one "
                "sample an epoch; use a larger epoch_size or fewer ranks or workers",
                name="epoch_size",
                value=self.epoch_size,
            )
        each = self.per_consumer(wanted, consumers)
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
            "epoch_size": wanted,
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
        runs = self._epoch_runs(epoch, units, slot // per_unit, per_unit * each)
        return self._deal(runs, self._base, each, per_unit, slot)

    def _epoch_runs(self, epoch: int, units: int, unit: int, wanted: int) -> list[Run]:
        """The ``wanted`` samples (or all, when more) the unit reads in the epoch, in the
        epoch's order (the last unit's kept: its consumers ask in turn).

        Fewer than the unit owns: the epoch's window of an endless cycle through them (an
        order drawn from the seed alone), so consecutive epochs deliver every sample
        before any comes again."""
        key = (epoch, units, unit, wanted)
        if self._last_order[0] != key:
            runs = list(self.unit_shares(units)[unit])
            if 0 < wanted < sum(len(r) for r in runs):
                if self.shuffle:
                    runs.sort(key=lambda r: (_digest(self.seed, "cycle", r.shard), r.first))
                runs = list(_take(runs, epoch * wanted, wanted))
            if self.shuffle:
                runs.sort(key=lambda r: (_digest(self.seed, epoch, r.shard), r.first))
            self._last_order = (key, runs)
        return self._last_order[1]

    def share(self, left: Sequence[Piece], consumers: int, per_unit: int, slot: int) -> Share:
        """Consumer ``slot``'s equal part of an elastic resume's undelivered pieces: each
        goes to the unit owning its shard in this layout, evened out between units."""
        runs = [self.run_of(piece) for piece in left]
        samples = sum(len(r) for r in runs)
        each = self.per_consumer(samples, consumers) if samples else 0
        units = consumers // per_unit
        owner = owners(self.unit_shares(units), len(self.counts))
        held: list[list[Run]] = [[] for _ in range(units)]
        for run in runs:
            held[owner[run.shard]].append(run)
        loads = [sum(len(r) for r in unit) for unit in held]
        mine = even_out(held, quotas(samples, loads))[slot // per_unit]
        return self._deal(mine, runs, each, per_unit, slot)

    def unit_shares(self, units: int) -> list[list[Run]]:
        """The samples each of ``units`` owns in every fresh epoch (computed once)."""
        if units not in self._shares:
            self._shares[units] = cache_shares(self._order, self.counts, units)
        return self._shares[units]

    def shard_units(self, units: int) -> list[list[int]]:
        """The shards each of ``units`` reads in every epoch (for warming; a unit that owns
        no sample reads from every shard)."""
        return [sorted({r.shard for r in (runs or self._base)}) for runs in self.unit_shares(units)]

    def _deal(
        self, runs: Sequence[Run], everything: Sequence[Run], each: int, per_unit: int, slot: int
    ) -> Share:
        """Consumer ``slot``'s ``each`` samples of its unit's ``runs`` (they repeat when the
        unit owns fewer than its consumers read); a unit owning nothing repeats samples of
        ``everything``, from a place of its own."""
        unit, k = divmod(slot, per_unit)
        start, owned = k * each, sum(len(r) for r in runs)
        if not owned:
            runs, start = everything, unit * per_unit * each + start
        repeated = max(0, start + each - max(owned, start))
        return Share(self._pieces(_take(runs, start, each)), each, repeated)

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

    def _pieces(self, runs: Iterator[Run]) -> list[Piece]:
        return [Piece(r.shard, self.starts[r.shard][r.first], len(r)) for r in runs]


def indexing_shares(shards: int, seed: int, shuffle: bool, units: int) -> list[list[int]]:
    """The whole shards each of ``units`` holds before any sample count is known (what it
    indexes): the hand-out :meth:`EpochSplit.unit_shares` then evens out."""
    return whole_shards(_stable_order(shards, seed, shuffle), units)


def _stable_order(shards: int, seed: int, shuffle: bool) -> list[int]:
    """The shards in the order of the hand-out, drawn from the seed alone."""
    return list(epoch_order(shards, seed, -1, shuffle=shuffle))  # -1: not an epoch's


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
