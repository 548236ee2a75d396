"""The delivery check: what a job delivered of an epoch against what its plan says.

Every consumer (rank x DataLoader worker) keeps a tally (digest and count,
:mod:`shardcache._datasets.delivery_digest`) of the samples it delivered in its resume state;
the plan is deterministic (:mod:`shardcache._datasets.epoch_split`), so the tally the plan
predicts up to any recorded position is computed from the plan alone: the consumer's pieces
minus what its state says is left (:meth:`Progress.left`, the same accounting an elastic
resume deals out). Per-consumer counts come from each consumer's own plan, never from an
assumption that they are equal.

Where it runs (each consumer only knows its own tally; the job's is the sum of the states
the training loop already gathers for a checkpoint):

- **in each consumer**, by itself: on resume (a consumer's own state against its plan up to
  its position; an elastic resume's job state as a whole, below) and when its share of the
  epoch ends (its tally against its whole plan). In DataLoader workers an error reaches the
  training loop as the DataLoader's exception.
- **in the training process**, when asked (``check_delivery`` of the dataset): over the
  states of every rank (a :func:`~shardcache._datasets.resume_state.job_state`), at a
  checkpoint against the plan up to each consumer's position, at an epoch's end against
  the whole epoch's plan.

A job check sums the consumers' tallies and, after an elastic resume, the job's tallies
from before it (``prior``, carried in every consumer's state); its prediction is the whole
epoch's plan (every consumer's plan, plus the part planned before an elastic resume) minus
what :func:`~shardcache._datasets.resume_state.leftover` says is left. An elastic resume
checks the job state it is dealt from, then carries its seen and expected tallies on, so a
chain of resumes is checked at the epoch's end against the plan of the whole chain.

What a mismatch does is ``SHARDCACHE_DELIVERY_CHECK``: ``raise``
(:class:`~shardcache._base.errors.DeliveryMismatchError`), ``warn`` or ``off``; every check
counts in the metrics (``delivery_checks``, ``delivery_mismatches``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._base.errors import ConfigError, DeliveryMismatchError, ResumeError
from .._base.redact import get_logger
from .._observe import metrics
from .delivery_digest import Recorder, SampleHasher, Tally
from .epoch_split import EpochSplit
from .resume_plan import Piece
from .resume_start import plan_for
from .resume_state import Progress, leftover

logger = get_logger(__name__)


@dataclass(frozen=True)
class DeliveryCheck:
    """One check: ``seen``, ``skipped`` (samples of the plan a handler gave up on) and
    ``expected`` as tallies (count, digest), where it was made
    (``at``: "checkpoint", "end of epoch", "elastic resume", "resume of consumer 3 (of 4)",
    "end of the share of consumer 3 (of 4)"), and whether every
    consumer had reached its plan's end (``complete``)."""

    epoch: int
    source: str | None
    at: str
    seen: Tally
    expected: Tally
    complete: bool
    skipped: Tally = field(default_factory=Tally)  # of the plan, by a handler: not delivered

    @property
    def ok(self) -> bool:
        return self.seen + self.skipped == self.expected

    def as_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "source": self.source,
            "at": self.at,
            "ok": self.ok,
            "complete": self.complete,
            "seen": self.seen.as_json(),
            "skipped": self.skipped.as_json(),
            "expected": self.expected.as_json(),
        }


class Checker:
    """The checks of one dataset (a mixture's source: ``source``) over its split."""

    def __init__(
        self, split: EpochSplit, urls: Sequence[str], source: str | None, mode: str
    ) -> None:
        self.split, self.urls, self.source, self.mode = split, urls, source, mode

    def hasher(self, epoch: int) -> SampleHasher:
        return SampleHasher(self.urls, epoch, self.source)

    # -- predictions ----------------------------------------------------------------

    def consumer(self, progress: Progress, at: str) -> DeliveryCheck | None:
        """A consumer's tally against its plan up to its position (None: no tally)."""
        if progress.seen is None:
            return None
        hasher = self.hasher(progress.epoch)
        run_of = self.split.run_of
        whole = hasher.runs(run_of(p) for p in progress.plan)
        left = progress.left()
        expected = whole - hasher.runs(run_of(p) for p in left)
        return DeliveryCheck(
            progress.epoch, self.source, at, progress.seen, expected, not left, progress.skipped
        )

    def job(self, job: Mapping[str, Any], at: str, *, epoch_end: bool) -> DeliveryCheck | None:
        """A job state's tallies against the plan: up to each consumer's position, or
        (``epoch_end``) the whole epoch's (None: a state without tallies)."""
        epoch = int(job["epoch"])
        parts = [p for p in job["parts"] if p.get("kind") == "consumer"]
        if not parts:
            if epoch_end:
                raise ResumeError(
                    f"check_delivery at the end of epoch {epoch} was given no consumer's "
                    "state (only states from before iteration began); pass every rank's "
                    "StatefulDataLoader.state_dict() taken after the epoch's last batch",
                    epoch=epoch,
                )
            return DeliveryCheck(epoch, self.source, at, Tally(), Tally(), False)
        if any(p.get("seen") is None for p in parts):
            return None
        priors = {repr(p.get("prior")) for p in parts}
        if len(priors) > 1:
            raise ResumeError(
                f"the consumers' states of epoch {epoch} disagree on what the job delivered "
                "before their elastic resume: they come from different jobs or checkpoints; "
                "gather the states of one checkpoint",
                epoch=epoch,
                seen=sorted(priors),
            )
        prior = parts[0].get("prior") or {}
        seen = Tally.from_json(prior["seen"]) if prior else Tally()
        skipped = Tally.from_json(prior["skipped"]) if prior else Tally()
        whole = Tally.from_json(prior["expected"]) if prior else Tally()
        plans = plan_for(self.split, epoch)
        hasher = self.hasher(epoch)
        run_of = self.split.run_of
        consumers, per_unit = int(parts[0]["consumers"]), int(parts[0]["per_unit"])
        by_slot = {int(p["slot"]): p for p in parts}
        left, _ = leftover(job, plans)  # refuses a resumed epoch's state missing a consumer
        for slot in range(consumers):
            state = by_slot.get(slot)
            if state is None:  # delivered nothing of a fresh epoch: its plan is all left
                plan = plans(consumers, per_unit, slot)
            else:
                progress = Progress.from_json(state, plans)
                plan, seen, skipped = (
                    progress.plan,
                    seen + progress.seen,
                    skipped + progress.skipped,
                )
            whole += hasher.runs(run_of(p) for p in plan)
        expected = whole if epoch_end else whole - hasher.runs(run_of(p) for p in left)
        return DeliveryCheck(epoch, self.source, at, seen, expected, not left, skipped)

    # -- the checks, acted on -------------------------------------------------------

    def job_check(self, job: Mapping[str, Any], *, epoch_end: bool) -> DeliveryCheck | None:
        """A job state at a checkpoint or (``epoch_end``) after the epoch's last batch."""
        at = "end of epoch" if epoch_end else "checkpoint"
        return self.settle(self.job(job, at, epoch_end=epoch_end))

    def resumed(self, progress: Progress) -> Progress:
        """A consumer resumed exactly: its state's tally against its plan."""
        if self.mode != "off":
            self.settle(self.consumer(progress, f"resume of {_consumer(progress)}"))
        return progress

    def elastic(self, job: Mapping[str, Any], *, loud: bool) -> DeliveryCheck | None:
        """The job state an elastic resume is dealt from (computed even when not checked:
        the resumed epoch carries its tallies on); ``loud``: this consumer reports it."""
        check = self.job(job, "elastic resume", epoch_end=False)
        return check if self.mode == "off" else self.settle(check, loud=loud)

    def share_end(self, progress: Progress) -> DeliveryCheck | None:
        """A consumer at the end of its share: its tally against its whole plan."""
        if self.mode == "off":
            return None
        return self.settle(self.consumer(progress, f"end of the share of {_consumer(progress)}"))

    def settle(self, check: DeliveryCheck | None, *, loud: bool = True) -> DeliveryCheck | None:
        """Count ``check`` and act on a mismatch: raise, warn (``loud``: at WARNING, else
        DEBUG) or nothing; ``loud=False`` also leaves it uncounted (one of several
        consumers making the same job check)."""
        if check is None:
            logger.info(
                "the resume state was written by a shardcache without delivery tallies: "
                "what epoch %s delivers is not checked",
                "?" if self.source is None else f"{self.source!r}'s",
            )
            return None
        if loud:
            metrics.count(delivery_checks=1, delivery_mismatches=0 if check.ok else 1)
        if check.ok:
            logger.debug("delivery check (%s) of epoch %d: %s", check.at, check.epoch, check.seen)
            return check
        error = mismatch(check)
        if self.mode == "raise":
            raise error
        (logger.warning if loud else logger.debug)("%s", error.message)
        return check


def _consumer(progress: Progress) -> str:
    return f"consumer {progress.slot} (of {progress.consumers})"


def mode_of(given: str | None, default: str) -> str:
    """The mode a check acts by: ``given`` ("raise" or "warn"), else ``default``."""
    if given is None:
        return default
    if given not in ("raise", "warn"):
        raise ConfigError(
            f"on_mismatch must be 'raise' or 'warn', not {given!r}",
            name="on_mismatch",
            value=given,
        )
    return given


def mismatch(check: DeliveryCheck) -> DeliveryMismatchError:
    seen, expected = check.seen, check.expected
    source = "" if check.source is None else f" (source {check.source!r})"
    accounted = seen + check.skipped
    if accounted.count != expected.count:
        what = (
            f"{abs(accounted.count - expected.count)} samples "
            f"{'fewer' if accounted.count < expected.count else 'more'} than planned"
        )
    else:
        what = "as many samples as planned, but not the planned ones"
    return DeliveryMismatchError(
        f"epoch {check.epoch}{source}, {check.at}: delivered {seen}"
        + (f" and skipped {check.skipped} (the handler)" if check.skipped.count else "")
        + f", the plan says "
        f"{expected}: {what}. Samples were skipped or repeated: states gathered from "
        "different steps, an edited or stale state, a consumer stopped before its plan's "
        "end, or a bug (please report it with the states). SHARDCACHE_DELIVERY_CHECK=warn "
        "logs this instead; resuming from an earlier checkpoint, or starting the epoch "
        "again, delivers the plan",
        epoch=check.epoch,
        source=check.source,
        at=check.at,
        expected=expected.as_json(),
        seen=seen.as_json(),
    )


def carried(check: DeliveryCheck | None) -> dict[str, Any] | None:
    """What an elastic resume carries on of the job state it was dealt from."""
    if check is None:
        return None
    return {
        "seen": check.seen.as_json(),
        "skipped": check.skipped.as_json(),
        "expected": check.expected.as_json(),
    }


def skipper(
    progress: Progress, recorder: Recorder, split: EpochSplit
) -> Callable[[int, Sequence[tuple[int, int, str]]], None]:
    """``skip(upto, lost)``: count as skipped (a handler's doing) the samples from
    ``progress``'s position to piece ``upto`` and the buffered samples ``lost``."""

    def skip(upto: int, lost: Sequence[tuple[int, int, str]]) -> None:
        pieces = progress.ahead(upto) + [Piece(shard, offset, 1) for shard, offset, _ in lost]
        if pieces:
            progress.skipped += recorder.hasher.runs(split.run_of(p) for p in pieces)

    return skip


__all__ = ["Checker", "DeliveryCheck", "carried", "mismatch", "mode_of", "skipper"]
