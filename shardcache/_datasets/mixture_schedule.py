"""A mixture's weights over training: per epoch, and in steps within an epoch.

::

    def weights(epoch: int) -> list[shardcache.Step]:  # module level: workers unpickle it
        late = {"web": 0.2, "books": 0.6}  # anneal: the last 10 % of each epoch from 3 on
        return [shardcache.Step(0, {})] + ([shardcache.Step(900, late)] if epoch >= 3 else [])

    dataset = shardcache.MixtureDataset(sources, epoch_size=1000, schedule=weights)

A schedule is a list (entry ``e`` for epoch ``e``, the last for every later epoch) or a
function of the epoch (deterministic; picklable, e.g. a module's function, when DataLoader
workers are spawned). An entry is the sources' weights by name (the whole epoch) or
:class:`Step` s: from sample ``at`` of the epoch on (the first at 0), ``weights``. A name
not given keeps its :class:`~shardcache._datasets.mixture.Source` ``weight``; weight 0
leaves a source out of a step (it joins again with a weight above 0). Each step's samples
are split by its weights (largest remainders): the epoch's steps, laid one after another,
are what the consumers split together (:class:`~shardcache._datasets.epoch_split.Lay`),
each consumer mixing step by step.

A state records the schedule's values at its epoch: every step's start, weights and
counts (what the rest of that epoch follows; later epochs follow the schedule given at
resume), and each source's samples in the epochs before (where its walk through its
samples stands: :meth:`~shardcache._datasets.epoch_split.EpochSplit.walked`).
:meth:`MixtureSchedule.check` refuses a state whose epoch, or epochs before, differ, naming
the first difference: the epoch, the step and the source, the state's value and the
schedule's.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._base.errors import ConfigError, ResumeError
from .epoch_split import consumer_counts


@dataclass(frozen=True)
class Step:
    """From sample ``at`` of an epoch on, the sources' ``weights`` (by name; a source not
    named keeps its ``Source`` weight)."""

    at: int
    weights: Mapping[str, float] = field(default_factory=dict)


Entry = Mapping[str, float] | Sequence[Step]
Steps = list[list[int]]  # samples of each source (a column) in each step (a row)
Schedule = Sequence[Entry] | Callable[[int], Entry]


@dataclass(frozen=True)
class EpochStep:
    """One step of an epoch: its first sample, and each source's weight and samples."""

    at: int
    weights: tuple[float | None, ...]
    counts: tuple[int, ...]


class Amount(Protocol):
    """What a source gets an epoch: a weight or a count (a ``Source``)."""

    @property
    def weight(self) -> float | None: ...

    @property
    def samples(self) -> int | None: ...


def weighted_counts(weights: Sequence[float], samples: int) -> list[int]:
    """``samples`` split by ``weights`` (largest remainders: they add up exactly)."""
    total = sum(weights)
    if total == 0:
        return [0] * len(weights)
    exact = [samples * w / total for w in weights]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: samples - sum(shares)]:
        shares[i] += 1
    return shares


def checked_weight(weight: Any, whose: str) -> float:
    """``weight``, a finite number >= 0 (else a ``ConfigError`` naming ``whose`` it is)."""
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not number or not math.isfinite(weight) or weight < 0:
        raise ConfigError(
            f"{whose}: weight must be a finite number >= 0, not {weight!r}",
            name="weight",
            value=weight,
        )
    return weight


def epoch_counts(sources: Sequence[Amount], epoch_size: int | None) -> list[int]:
    """The samples each source gets an epoch: its ``samples``, or its weight's share of
    what ``epoch_size`` leaves (largest remainders, so they add up exactly)."""
    fixed = sum(s.samples for s in sources if s.samples is not None)
    weights = [s.weight for s in sources if s.weight is not None]
    if not weights:
        return [s.samples or 0 for s in sources]
    if epoch_size is None:
        raise ConfigError(
            "a mixture with weights needs epoch_size: a weight is a share of the epoch's "
            "samples (give epoch_size=N, or samples= to every source)",
            name="epoch_size",
            value=None,
        )
    if epoch_size < fixed:
        raise ConfigError(
            f"epoch_size={epoch_size} is smaller than the {fixed} samples the sources with "
            "samples= take; raise epoch_size or lower those counts",
            name="epoch_size",
            value=epoch_size,
        )
    left = epoch_size - fixed
    if left and not any(weights):
        raise ConfigError(
            f"epoch_size={epoch_size} leaves {left} samples to the sources with weights, "
            "but every weight is 0; give one a positive weight, or lower epoch_size to the "
            "samples= total",
            name="weight",
            value=0,
        )
    it = iter(weighted_counts(weights, left))
    return [s.samples if s.samples is not None else next(it) for s in sources]


class MixtureSchedule:
    """The steps of every epoch of a mixture of ``names`` (``weights`` the sources' own,
    None for a ``samples=`` source; ``counts`` their samples an epoch without a
    schedule; ``sizes`` the epoch size and ``remainder``)."""

    def __init__(
        self,
        names: Sequence[str],
        weights: Sequence[float | None],
        counts: Sequence[int],
        sizes: tuple[int | None, str],
        schedule: Schedule | None = None,
    ) -> None:
        self.names = list(names)
        self._weights = tuple(weights)
        self._counts = tuple(counts)
        self.epoch_size, self.remainder = sizes
        epoch_size = self.epoch_size
        self.schedule = schedule
        self._steps: dict[int, tuple[EpochStep, ...]] = {}
        self._kept_before: tuple[int, dict[str, Any]] = (-1, {})
        if schedule is None:
            return
        if epoch_size is None:
            raise ConfigError(
                "a mixture with a schedule needs epoch_size: the schedule's weights are "
                "shares of the epoch's samples",
                name="epoch_size",
                value=None,
            )
        if None in self._weights:
            name = self.names[self._weights.index(None)]
            raise ConfigError(
                f"source {name!r} has samples= but the mixture has a schedule of weights; "
                "give every source a weight=",
                name="samples",
                value=name,
            )
        if not callable(schedule):
            if isinstance(schedule, (str, bytes, Mapping)) or not isinstance(schedule, Sequence):
                raise ConfigError(
                    "schedule must be a list of entries (one an epoch, the last for every "
                    f"later epoch) or a function of the epoch, not {schedule!r:.80}",
                    name="schedule",
                    value=schedule,
                )
            if not schedule:
                raise ConfigError("schedule is an empty list", name="schedule", value=[])
            for epoch in range(len(schedule)):  # a list's mistakes show now, not epochs later
                self.steps(epoch)
        else:
            self.steps(0)

    def steps(self, epoch: int) -> tuple[EpochStep, ...]:
        """Epoch ``epoch``'s steps (one without a schedule), computed once."""
        if epoch not in self._steps:
            if self.schedule is None:
                self._steps[epoch] = (EpochStep(0, self._weights, self._counts),)
            else:
                self._steps[epoch] = self._scheduled(epoch)
        return self._steps[epoch]

    def lay(self, epoch: int) -> tuple[int, ...]:
        """Every step's counts of every source, one step after another."""
        return tuple(c for step in self.steps(epoch) for c in step.counts)

    def consumer_steps(self, lay: Sequence[int], where: tuple[int, int, int]) -> list[list[int]]:
        """Each step's samples of every source for one consumer of a fresh epoch laid out
        as ``lay``: ``where`` is (consumers, consumers a cache, the consumer's slot)."""
        consumers, per_unit, slot = where
        laid = consumer_counts(lay, consumers, self.remainder, per_unit)
        n = len(self.names)
        return [[laid[k + i][slot] for i in range(n)] for k in range(0, len(laid), n)]

    def job_leftover(
        self, epoch: int, jobs: Sequence[Mapping[str, Any]], left: Steps | None
    ) -> Steps | None:
        """The job's undelivered samples of each source in each step of ``epoch``, from
        every source's job state (None: no consumer had started); ``left`` is what the
        epoch was itself dealt from, when it was resumed elastically."""
        by_source = [
            {int(p["slot"]): p for p in job.get("parts", []) if p.get("kind") == "consumer"}
            for job in jobs
        ]
        first = next((p for parts in by_source for p in parts.values()), None)
        if first is None:
            return None
        consumers, per_unit = int(first["consumers"]), int(first["per_unit"])
        lay = self.lay(epoch)
        out = [[0] * len(self.names) for _ in range(len(lay) // len(self.names))]
        for slot in range(consumers):
            parts = [parts.get(slot) or {} for parts in by_source]
            taken = [int(p.get("delivered", 0)) for p in parts]
            if left is None:
                steps = self.consumer_steps(lay, (consumers, per_unit, slot))
            else:
                steps = split_by(left, [int((p.get("sizes") or {}).get("own", 0)) for p in parts])
            for row, rest in zip(out, remaining(steps, taken), strict=False):
                row[:] = [a + b for a, b in zip(row, rest, strict=True)]
        return out

    def _scheduled(self, epoch: int) -> tuple[EpochStep, ...]:
        assert self.schedule is not None and self.epoch_size is not None
        schedule = self.schedule
        entry = schedule(epoch) if callable(schedule) else schedule[min(epoch, len(schedule) - 1)]
        given = _steps_of(entry, epoch)
        ats = [step.at for step in given]
        whole = all(isinstance(a, int) and not isinstance(a, bool) for a in ats)
        if not whole or ats[0] != 0 or any(b <= a for a, b in itertools.pairwise(ats)):
            raise ConfigError(
                f"epoch {epoch}'s schedule steps start at samples {ats}: the first must start "
                "at 0 and each later one after the one before",
                name="schedule",
                value=ats,
            )
        if ats[-1] >= self.epoch_size:
            raise ConfigError(
                f"epoch {epoch}'s schedule has a step at sample {ats[-1]}, not within the "
                f"epoch's {self.epoch_size} samples",
                name="schedule",
                value=ats[-1],
            )
        out = []
        for step, end in zip(given, [*ats[1:], self.epoch_size], strict=True):
            weights = self._weights_of(step, epoch)
            counts = tuple(weighted_counts(weights, end - step.at))
            out.append(EpochStep(step.at, weights, counts))
        return tuple(out)

    def _weights_of(self, step: Step, epoch: int) -> tuple[float, ...]:
        unknown = sorted(set(step.weights) - set(self.names))
        if unknown:
            raise ConfigError(
                f"epoch {epoch}'s schedule names {unknown}, not a source of this mixture "
                f"(its sources: {self.names})",
                name="schedule",
                value=unknown[0],
            )
        weights = []
        for name, own in zip(self.names, self._weights, strict=True):
            weight = step.weights.get(name, own)
            weights.append(checked_weight(weight, f"epoch {epoch}'s schedule, source {name!r}"))
        if not any(weights):
            raise ConfigError(
                f"epoch {epoch}'s schedule gives every source weight 0 from sample "
                f"{step.at}: that step would have no sample",
                name="schedule",
                value=step.at,
            )
        return tuple(weights)

    # -- the state ------------------------------------------------------------------

    def record(self, epoch: int) -> dict[str, Any]:
        """The schedule at ``epoch`` (plain JSON), for the state; ``before``: each source's
        samples in the epochs before and a digest of their steps (where it walks on from)."""
        return {
            "epoch": epoch,
            "before": copy.deepcopy(self._before(epoch)),
            "steps": [
                {
                    "at": step.at,
                    "weights": dict(zip(self.names, step.weights, strict=True)),
                    "counts": dict(zip(self.names, step.counts, strict=True)),
                }
                for step in self.steps(epoch)
            ],
        }

    def _before(self, epoch: int) -> dict[str, Any]:
        """Each source's samples in the epochs before ``epoch``, and a digest of their
        steps (the last epoch's kept: a state is taken at every checkpoint)."""
        if self._kept_before[0] != epoch:
            lays = [self.lay(e) for e in range(epoch)]
            n = len(self.names)
            samples = {
                name: sum(sum(lay[i::n]) for lay in lays) for i, name in enumerate(self.names)
            }
            digest = hashlib.blake2b(repr(lays).encode(), digest_size=8).hexdigest()
            self._kept_before = (epoch, {"samples": samples, "digest": digest})
        return self._kept_before[1]

    def check(self, recorded: Any) -> None:
        """Refuse a state whose epoch's schedule (``recorded``, :meth:`record`'s) is not
        this one's, naming the first difference."""
        if not isinstance(recorded, Mapping) or not isinstance(recorded.get("epoch"), int):
            raise ResumeError(
                f"the mixture state has no schedule record ({recorded!r:.80}); pass what "
                "MixtureDataset.state_dict() or shardcache.job_state() returned",
                what="schedule",
                seen=recorded,
            )
        epoch = recorded["epoch"]
        now = self.record(epoch)
        _check_before(epoch, recorded.get("before") or {}, now["before"])
        theirs, mine = recorded.get("steps") or [], now["steps"]
        for k in range(max(len(theirs), len(mine))):  # where the steps start, then in them
            old_at = theirs[k].get("at") if k < len(theirs) else None
            new_at = mine[k]["at"] if k < len(mine) else None
            if old_at != new_at:
                raise _differs(epoch, k, "starts at sample", (None, old_at, new_at))
        for k, (old, new) in enumerate(zip(theirs, mine, strict=True)):
            for what in ("weights", "counts"):
                for name in self.names:
                    before, now = (old.get(what) or {}).get(name), new[what][name]
                    if before != now:
                        raise _differs(epoch, k, what, (name, before, now))


def remaining(steps: Sequence[Sequence[int]], taken: Sequence[int]) -> Steps:
    """A consumer's samples left of each step (``steps``, mixed one after another) when it
    has delivered ``taken`` of each source since the epoch began."""
    position, taken, out = sum(taken), list(taken), []
    for shares in steps:
        if position >= sum(shares):  # a step delivered already
            position -= sum(shares)
            taken = [t - s for t, s in zip(taken, shares, strict=True)]
            out.append([0] * len(shares))
        else:
            out.append([s - t for s, t in zip(shares, taken, strict=True)])
            position, taken = 0, [0] * len(shares)
    return out


def split_by(left: Steps, own: Sequence[int]) -> Steps:
    """A consumer's ``own`` samples of each source of an elastically resumed epoch, split
    over the steps as the job's leftover ``left`` is (the same for every consumer: an
    elastic share of a source is the same size for each); a source with nothing left
    anywhere (its own samples repeats) in the last step."""
    columns = []
    for i, count in enumerate(own):
        column = [row[i] for row in left]
        weights = column if any(column) else [0] * (len(left) - 1) + [1]
        columns.append(weighted_counts(weights, count))
    return [list(row) for row in zip(*columns, strict=True)]


def _check_before(epoch: int, theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Refuse a state whose epochs before ``epoch`` asked other samples of a source (or
    the same in other steps) than this schedule: each source walks on from them."""
    old = theirs.get("samples") or {}
    differs = [(n, old.get(n), now) for n, now in mine["samples"].items() if old.get(n) != now]
    if not differs and theirs.get("digest") == mine["digest"]:
        return
    name, before, now = differs[0] if differs else (None, theirs.get("digest"), mine["digest"])
    where = (
        f"source {name!r} samples {before!r} in the state, {now!r} in this schedule"
        if name is not None
        else f"each source's samples the same, their steps not: {before!r} in the state, "
        f"{now!r} in this schedule"
    )
    raise ResumeError(
        f"the state was taken with another mixture schedule in the epochs before its epoch "
        f"{epoch} ({where}): each source walks on through its samples from where those "
        "epochs left it; give the schedule the state was taken with for them (a schedule "
        "may differ only in the epochs after the state's)",
        what="schedule",
        epoch=epoch,
        source=name,
        expected=now,
        seen=before,
    )


def _steps_of(entry: Any, epoch: int) -> list[Step]:
    if isinstance(entry, Mapping):
        return [Step(0, entry)]
    if isinstance(entry, Sequence) and entry and all(isinstance(s, Step) for s in entry):
        return list(entry)
    raise ConfigError(
        f"epoch {epoch}'s schedule entry must be the sources' weights by name or a list of "
        f"shardcache.Step, not {entry!r:.80}",
        name="schedule",
        value=entry,
    )


def _differs(epoch: int, step: int, what: str, values: tuple[str | None, Any, Any]) -> ResumeError:
    """The error for a state taken with another schedule: where it first differs (the
    source, if one, the state's value and the schedule's)."""
    source, before, now = values
    if source is None:
        where = f"epoch {epoch}, step {step} {what} {before} in the state, {now} in this schedule"
    else:
        noun = "weight" if what == "weights" else "samples"
        where = (
            f"epoch {epoch}, step {step}: source {source!r} {noun} {before!r} in the state, "
            f"{now!r} in this schedule"
        )
    return ResumeError(
        f"the state was taken with another mixture schedule ({where}); resume with the "
        "weights and epoch_size the state was taken with (a schedule may differ only in "
        "the epochs after the state's)",
        what="schedule",
        epoch=epoch,
        step=step,
        source=source,
        expected=now,
        seen=before,
    )
