"""The sample-level split of an epoch: every consumer the same number of samples, each
shard read by the same cache in every epoch.

*Consumers* are rank x DataLoader worker (slot ``rank * workers + worker``), grouped into
*units* that share a cache: a rank's workers (rank scope) or a node's ranks and workers
(node scope, ranks numbered contiguously per node). With ``J`` consumers and ``T``
samples an epoch, each consumer gets ``N = T / J`` when ``J`` divides ``T``, else
``ceil(T / J)`` (``remainder="pad"``, the ``J * N - T`` missing ones repeat samples of the
epoch) or ``floor(T / J)`` (``"drop"``: ``T - J * N`` samples are left out of the epoch),
so every rank yields the same number of batches whatever the batch size.

A mixture's sources (:class:`Lay`, :func:`consumer_counts`) are split together: each
source's count ``c`` gives every consumer ``c // J`` and ``c % J`` consumers one more,
the sources' extra samples laid one after another round the consumers (the next source's
starting where the last one's ended; round the units first), so a source's counts differ by
at most one between consumers (and between units) and every consumer gets the same total:
``T / J`` exactly when ``J`` divides the mixture's ``T``. Only what cannot be split
equally in total (``T % J``) is padded (the last source repeats ``J - T % J`` samples) or
dropped (the last extra samples laid); a source with fewer samples than consumers goes to
some of them only. A source's units own what a lone dataset's would (the same in every
epoch) while each reads no more than that of it (the pad counted as the unit's consumers
spread it); else samples to match: the units its lay gives one more own one more
(:func:`lay_quotas`, :func:`filled`), so an epoch of no more samples than the source
holds repeats none, and one of more leaves none out. A mixture's source walks on through
its unit's samples over epochs (:meth:`EpochSplit.walked`): the epoch's window starts
where the unit's reads of the epochs before left it, whatever the schedule asked then.

Stable across epochs (what keeps later epochs in the cache): the shards, in an order drawn
from the seed alone, are handed out to the units by :func:`~shardcache._datasets.cache_shares.
cache_shares` (whole shards by count, nested by unit count so that another unit count moves
few of them, then evened out to equal sample counts). The whole shards need no sample
count (:func:`indexing_shares`): each unit learns the offsets of its own only. Changing
with the epoch: the order of the unit's shards (drawn from seed and epoch), which of its
samples repeat or are dropped (the ends of that order), and so which consumer reads what.
A unit that owns no sample at all (fewer samples than units) repeats samples of the whole
sequence.

``scope="global"`` deals anew every epoch: epoch ``e``'s hand-out is the one above of an
order drawn from ``(seed, -1 - e)`` (:func:`deal_order`; epoch 0's is the cache-local one,
the caches' *home* shares). An epoch size below the samples then takes a window of each
epoch's deal: no sample twice in an epoch, but epochs do not walk through the samples.

An elastic resume hands the samples left undelivered to the units owning their shards in
the new layout (the epoch's deal, with ``"global"``), evened out the same way, then deals
each unit's part to its consumers.

Everything here is a pure function of its arguments: every rank computes the same split.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from .._base.errors import ConfigError, SampleIndexError
from .cache_shares import Run, cache_shares, even_out, owners, quotas, whole_runs, whole_shards
from .resume_plan import Piece, epoch_order

REMAINDERS = ("pad", "drop")
SCOPES = ("cache", "global")  # shuffle scopes: each cache's own shards, or dealt anew
RELAID_KEPT = 4  # splits of other lays kept (a schedule's epochs of other counts)
SHARES_KEPT = 8  # hand-outs kept (of layouts, and with the "global" scope of epochs)


@dataclass(frozen=True)
class Lay:
    """The samples an epoch of every source split together (a mixture's, in its order;
    a lone dataset is one source), and which of them this split is. A mixture whose
    weights change within the epoch lays its steps one after another, ``width`` sources
    a step (0: one step), so this split's counts are at ``index``, ``index + width``...
    ``history`` gives every epoch's counts (a mixture's schedule): the source then walks
    on through its samples from where the epochs before left it
    (:meth:`EpochSplit.walked`)."""

    counts: tuple[int, ...]
    index: int = 0
    width: int = 0
    history: Callable[[int], Sequence[int]] | None = field(default=None, compare=False)

    @property
    def positions(self) -> range:
        """Where this split's counts are in :attr:`counts` (one a step)."""
        return range(self.index, len(self.counts), self.width or len(self.counts))


def consumer_counts(
    counts: Sequence[int],
    consumers: int,
    remainder: str,
    per_unit: int = 1,
    slots: Sequence[int] | None = None,
) -> list[list[int]]:
    """Each source's samples for each of ``consumers`` (``per_unit`` at a time sharing a
    cache): ``count // consumers``, plus one for the consumers its extra samples are laid
    on, each source's from where the previous one's ended. The lay goes round the caches
    first (the first consumer of every cache, then the second...), so a source's samples
    also differ by at most one between caches; it is cut (``"drop"``) or the last source's
    extended (``"pad"``) to whole rounds, so every consumer gets the same total. With
    ``slots``, those consumers' counts only."""
    total, units = sum(counts), consumers // per_unit
    rest = total % consumers
    end = sum(c % consumers for c in counts) - rest  # the extra samples laid, in all
    if remainder == "pad" and rest:
        end += consumers
    padded = max((i for i, c in enumerate(counts) if c), default=len(counts) - 1)
    slots = range(consumers) if slots is None else slots
    place = [(slot % per_unit) * units + slot // per_unit for slot in slots]
    out, start = [], 0
    for i, count in enumerate(counts):
        stop = start + count % consumers
        length = max(0, (end if i == padded and remainder == "pad" else min(stop, end)) - start)
        base, extra = count // consumers + length // consumers, length % consumers
        out.append([base + ((p - start) % consumers < extra) for p in place])
        start = stop
    return out


def lay_quotas(total: int, units: int, first: int) -> list[int]:
    """``total`` split into ``units`` equal parts (to one sample), the larger parts on the
    units from ``first`` on (round): where :func:`consumer_counts` lays a source's extra
    samples from, so the caches that read one more of it own one more of it."""
    each, extra = divmod(total, units)
    return [each + ((unit - first) % units < extra) for unit in range(units)]


def filled(asked: Sequence[int], total: int) -> list[int]:
    """``total`` (at least ``sum(asked)``) split so that each part holds its ``asked`` and
    the rest raises the smallest parts first, to one sample (ties: the lower index): what a
    source's caches own when its steps ask them unequal counts."""
    low, spare = sorted(asked), total - sum(asked)
    level, k = low[0], 1
    while k < len(low) and (low[k] - level) * k <= spare:
        spare -= (low[k] - level) * k
        level, k = low[k], k + 1
    level, spare = level + spare // k, spare % k
    parts = [max(a, level) for a in asked]
    for unit, part in enumerate(parts):
        if spare and part == level:
            parts[unit], spare = part + 1, spare - 1
    return parts


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
        lay: Lay | None = None,
        scope: str = "cache",
    ) -> None:
        scope_rule(scope, shuffle)
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
        self.scope = scope
        self.counts = [len(s) for s in starts]
        self.total = sum(self.counts)
        if self.total == 0:
            raise SampleIndexError(
                f"the {len(starts)} shards hold no sample at all: there is nothing to train "
                "on (check the shard list, or the shards' member names: a sample is members "
                "sharing a key, name.suffix)",
                shards=len(starts),
            )
        wanted = self.total if epoch_size is None else epoch_size
        self.lay = Lay((wanted,)) if lay is None else lay  # a mixture's sources split together
        self._laid = lay is not None
        self._own: dict[tuple[int, int], list[int]] = {}
        self._relaid: dict[Lay, EpochSplit] = {self.lay: self}  # shared by relaid() copies
        self._walks: dict[tuple[int, int, int], tuple[int, int]] = {}  # shared too
        self._order = order = _stable_order(len(starts), seed, shuffle)
        self._base = [Run(s, 0, self.counts[s]) for s in order if self.counts[s] > 0]
        self._shares: dict[tuple[int, int, int], list[list[Run]]] = {}
        self._last_order: tuple[tuple[int | None, ...] | None, list[Run], int] = (None, [], 0)
        self.digest = hashlib.blake2b(
            repr(self.counts).encode(), digest_size=12
        ).hexdigest()  # the sample layout a state was taken with

    # -- sizes ----------------------------------------------------------------------

    def per_consumer(self, samples: int, consumers: int) -> int:
        """Samples each of ``consumers`` gets out of ``samples``."""
        if self.remainder == "pad":
            return -(-samples // consumers)
        return samples // consumers

    def own_counts(self, consumers: int, per_unit: int = 1) -> list[int]:
        """This split's samples for each of ``consumers`` (``per_unit`` a cache) in a fresh
        epoch (computed once); every consumer's total over the :class:`Lay`'s sources is
        the same."""
        key = (consumers, per_unit)
        if key not in self._own:
            self._check_sizes(consumers)
            laid = consumer_counts(self.lay.counts, consumers, self.remainder, per_unit)
            steps = [laid[i] for i in self.lay.positions]
            self._own[key] = [sum(counts) for counts in zip(*steps, strict=True)]
        return self._own[key]

    def _check_sizes(self, consumers: int) -> None:
        asked = sum(self.lay.counts)
        if (self.epoch_size is not None or self._laid) and asked < consumers:
            raise ConfigError(
                f"epoch_size={asked} is smaller than the job's {consumers} "
                "consumers (ranks x DataLoader workers): each must yield at least one "
                "sample an epoch; use a larger epoch_size or fewer ranks or workers",
                name="epoch_size",
                value=asked,
            )
        if self.remainder == "drop" and asked < consumers:
            raise ConfigError(
                f"remainder='drop' with {consumers} consumers (ranks x DataLoader workers) "
                f"and {asked} samples: every sample would be dropped; use "
                "remainder='pad' (samples repeat) or fewer ranks or workers",
                name="remainder",
                value="drop",
            )

    def totals(self, consumers: int, per_unit: int = 1) -> dict[str, int]:
        """The fresh epoch's sizes for a job of ``consumers``: samples in the shards, the
        epoch size asked for, per consumer (the most any gets: in a mixture, a source's
        counts differ by one between consumers), repeated and dropped (job-wide; with an
        epoch size below the samples, "dropped" ones come first in the next epochs)."""
        own = self.own_counts(consumers, per_unit)
        given = sum(own)
        return {
            "samples": self.total,
            "epoch_size": sum(self.lay.counts[i] for i in self.lay.positions),
            "per_consumer": max(own),
            "repeated": max(0, given - self.total),
            "dropped": max(0, self.total - given),
        }

    # -- plans ----------------------------------------------------------------------

    def fresh(self, epoch: int, consumers: int, per_unit: int, slot: int) -> Share:
        """Consumer ``slot``'s share of a fresh epoch; consumers ``per_unit`` at a time share
        a cache (``consumers`` is a multiple of ``per_unit``)."""
        own = self.own_counts(consumers, per_unit)
        unit = slot // per_unit
        wanted = sum(own[unit * per_unit : (unit + 1) * per_unit])
        walked = None
        if self.lay.history is not None:
            walked = self.walked(epoch, consumers, per_unit, unit)
        runs, held = self._epoch_runs(
            epoch, (consumers // per_unit, per_unit), unit, wanted, walked
        )
        return self._deal(runs, self._base, own, per_unit, slot, held)

    def walked(self, epoch: int, consumers: int, per_unit: int, unit: int) -> int:
        """The samples of this source ``unit`` read in the epochs before ``epoch`` (by the
        :class:`Lay`'s history, as a job of ``consumers`` would have): where its walk
        through its samples stands (kept, so each epoch's counts are split once)."""
        assert self.lay.history is not None
        key = (consumers, per_unit, unit)
        done, walked = self._walks.get(key, (0, 0))
        if done > epoch:  # an earlier epoch again: from the start
            done, walked = 0, 0
        for before in range(done, epoch):
            walked += self._unit_reads(self.lay.history(before), consumers, per_unit, unit)[0]
        self._walks[key] = (epoch, walked)
        return walked

    def _epoch_runs(
        self, epoch: int, units: tuple[int, int], unit: int, wanted: int, walked: int | None
    ) -> tuple[list[Run], int]:
        """The ``wanted`` samples (or all, when more) the unit reads in the epoch, in the
        epoch's order, and how many samples it owns (the last unit's kept: its consumers
        ask in turn); ``units`` is the units and the consumers of each.

        Fewer than the unit owns: the epoch's window of an endless cycle through them (an
        order drawn from the seed alone), so consecutive epochs deliver every sample
        before any comes again. With ``walked`` (a mixture's: the unit's samples read in
        the epochs before), the window starts there and is taken whatever ``wanted`` is,
        so however the counts change between epochs, every sample comes once before any
        comes again (and, when more than it owns, each as often as the others to one)."""
        key = (epoch, units, unit, wanted, walked)
        if self._last_order[0] != key:
            runs = list(self.unit_shares(*units, epoch=epoch)[unit])
            held = sum(len(r) for r in runs)
            if walked is not None or 0 < wanted < held:
                if self.shuffle:
                    runs.sort(key=lambda r: (_digest(self.seed, "cycle", r.shard), r.first))
                start = epoch * wanted if walked is None else walked
                runs = list(_take(runs, start, wanted))
            if self.shuffle:
                runs.sort(key=lambda r: (_digest(self.seed, epoch, r.shard), r.first))
            self._last_order = (key, runs, held)
        return self._last_order[1], self._last_order[2]

    def share(
        self, left: Sequence[Piece], consumers: int, per_unit: int, slot: int, epoch: int = 0
    ) -> Share:
        """Consumer ``slot``'s equal part of an elastic resume's undelivered pieces of
        ``epoch``: each goes to the unit owning its shard in this layout (in the epoch's
        deal), evened out between units."""
        runs = [self.run_of(piece) for piece in left]
        samples = sum(len(r) for r in runs)
        each = self.per_consumer(samples, consumers) if samples else 0
        units = consumers // per_unit
        owner = owners(self.unit_shares(units, per_unit, epoch), len(self.counts))
        held: list[list[Run]] = [[] for _ in range(units)]
        for run in runs:
            held[owner[run.shard]].append(run)
        loads = [sum(len(r) for r in unit) for unit in held]
        mine = even_out(held, quotas(samples, loads))[slot // per_unit]
        return self._deal(mine, runs, [each] * consumers, per_unit, slot)

    def unit_shares(self, units: int, per_unit: int = 1, epoch: int = 0) -> list[list[Run]]:
        """The samples each of ``units`` (of ``per_unit`` consumers each) owns in a fresh
        ``epoch`` (computed once; the same in every epoch but with the ``"global"`` scope).
        A mixture's source owns its lone hand-out, while no unit reads more than that of
        it; else the larger shares where its lay reads more."""
        deal = epoch if self.scope == "global" else 0
        key = (units, per_unit, deal)
        if key not in self._shares:
            order = self._order if deal == 0 else deal_order(len(self.counts), self.seed, deal)
            lay, shares = self.lay, cache_shares(order, self.counts, units)
            reads = [0] * units
            if len(lay.counts) > 1:  # a mixture's source
                reads = self._unit_reads(lay.counts, units * per_unit, per_unit)
            if any(r > sum(map(len, mine)) for r, mine in zip(reads, shares, strict=True)):
                held = whole_runs(order, self.counts, units)
                if len(lay.positions) == 1:  # where its one lay starts (round the units)
                    parts = lay_quotas(self.total, units, sum(lay.counts[: lay.index]) % units)
                elif sum(reads) <= self.total:  # each unit owns what it reads, and the rest
                    parts = filled(reads, self.total)
                else:
                    parts = quotas(self.total, reads)
                shares = even_out(held, parts)
            if len(self._shares) >= SHARES_KEPT:  # the oldest goes (a deal an epoch)
                del self._shares[next(iter(self._shares))]
            self._shares[key] = shares
        return self._shares[key]

    def _unit_reads(
        self, counts: Sequence[int], consumers: int, per_unit: int, unit: int | None = None
    ) -> list[int]:
        """The samples of this split each unit (or only ``unit``) reads in an epoch of
        ``counts`` (a :class:`Lay`'s) with ``consumers``, ``per_unit`` a cache."""
        units = range(consumers // per_unit) if unit is None else [unit]
        slots = [u * per_unit + k for u in units for k in range(per_unit)]
        laid = consumer_counts(counts, consumers, self.remainder, per_unit, slots)
        mine = range(self.lay.index, len(counts), self.lay.width or len(counts))
        reads = [0] * len(units)
        for at in range(len(slots)):
            reads[at // per_unit] += sum(laid[i][at] for i in mine)
        return reads

    def relaid(self, lay: Lay) -> EpochSplit:
        """This split with another :class:`Lay` (a mixture's epoch of other weights): the
        same shards and order, its own counts (each lay's split made once)."""
        if lay not in self._relaid:
            split = copy.copy(self)
            split.lay, split._laid = lay, True
            split._own, split._shares, split._last_order = {}, {}, (None, [], 0)
            if len(self._relaid) > RELAID_KEPT:  # the oldest goes (each holds its shares)
                del self._relaid[next(iter(self._relaid))]
            self._relaid[lay] = split
        return self._relaid[lay]

    def shard_units(self, units: int, per_unit: int = 1, epoch: int = 0) -> list[list[int]]:
        """The shards each of ``units`` reads in ``epoch`` (in every epoch but with the
        ``"global"`` scope; for warming; a unit that owns no sample reads from every
        shard)."""
        return [
            sorted({r.shard for r in (runs or self._base)})
            for runs in self.unit_shares(units, per_unit, epoch)
        ]

    def _deal(  # noqa: PLR0917
        self,
        runs: Sequence[Run],
        everything: Sequence[Run],
        counts: Sequence[int],
        per_unit: int,
        slot: int,
        held: int | None = None,
    ) -> Share:
        """Consumer ``slot``'s ``counts[slot]`` samples of its unit's ``runs``, after those
        of the unit's consumers before it (they repeat when the unit owns fewer than its
        consumers read: ``held``, when ``runs`` is the walk's window); a unit owning
        nothing repeats samples of ``everything``, from a place of its own."""
        each = counts[slot]
        start = sum(counts[slot - slot % per_unit : slot])
        owned = sum(len(r) for r in runs) if held is None else held
        if not owned:
            runs, start = everything, sum(counts[:slot])
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


def scope_rule(scope: str, shuffle: bool) -> str:
    """``scope`` if it is one of :data:`SCOPES` (``"global"`` with a shuffle), else a
    ConfigError saying what each does."""
    if scope not in SCOPES or (scope == "global" and not shuffle):
        raise ConfigError(
            f"shuffle_scope must be one of {SCOPES} ('global' with shuffle_shards=True "
            f"only), not {scope!r}: 'cache' reads each cache's own shards every epoch, "
            "'global' deals the shards across the whole job anew every epoch",
            name="shuffle_scope",
            value=scope,
        )
    return scope


def indexing_shares(shards: int, seed: int, shuffle: bool, units: int) -> list[list[int]]:
    """The whole shards each of ``units`` holds before any sample count is known (what it
    indexes): the hand-out :meth:`EpochSplit.unit_shares` then evens out."""
    return whole_shards(_stable_order(shards, seed, shuffle), units)


def _stable_order(shards: int, seed: int, shuffle: bool) -> list[int]:
    """The shards in the order of the hand-out, drawn from the seed alone."""
    return deal_order(shards, seed, 0) if shuffle else list(range(shards))


def deal_order(shards: int, seed: int, epoch: int) -> list[int]:
    """The shards in the order of ``epoch``'s hand-out with the ``"global"`` scope: drawn
    from ``(seed, -1 - epoch)``, apart from the orders within epochs (``(seed, epoch)``);
    epoch 0's is the cache-local hand-out's."""
    return epoch_order(shards, seed, -1 - epoch)


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
