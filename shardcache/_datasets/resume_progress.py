"""Where a consumer's iteration of an epoch starts, and the line that announces it: a fresh
epoch's share, its own loaded state (exact), or its share of what a job state left
undelivered (elastic), each loaded state checked first (its layout, its consumer, what it
delivered against its plan: :mod:`shardcache._datasets.delivery_check`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._base.redact import get_logger
from .delivery_check import Checker, carried
from .delivery_digest import Tally
from .epoch_split import EpochSplit
from .resume_start import check_layout, check_same_consumer, plan_for, start_progress
from .resume_state import Progress, State, leftover

logger = get_logger(__name__)


@dataclass(frozen=True)
class Consumer:
    """A consumer's place in the job: its slot, the number of consumers, and how many
    share its cache."""

    slot: int
    consumers: int
    per_unit: int


def progress_for(
    split: EpochSplit,
    epoch: int,
    pending: State | None,
    consumer: Consumer,
    checker: Checker,
    *,
    buffer_size: int,
) -> Progress:
    """The progress ``consumer`` starts ``epoch`` from: ``pending`` (a loaded state, or
    None for a fresh epoch) resumed exactly or elastically, each check passed first."""
    slot, consumers, per_unit = consumer.slot, consumer.consumers, consumer.per_unit
    plan = plan_for(split, epoch)
    if pending is not None and pending["kind"] != "start":
        check_layout(pending, split)
    if pending is not None and pending["kind"] == "consumer":
        check_same_consumer(pending, consumers, per_unit, slot)
        return checker.resumed(Progress.from_json(pending, plan))
    if pending is not None and pending["kind"] == "job":
        parts = {p["slot"]: p for p in pending["parts"] if p["kind"] == "consumer"}
        same_layout = all(
            (p["consumers"], p["per_unit"]) == (consumers, per_unit) for p in parts.values()
        )
        if parts and same_layout and len(parts) == consumers:  # every consumer: exact
            return checker.resumed(Progress.from_json(parts[slot], plan))
        if parts:
            return _elastic(split, epoch, pending, consumer, checker, buffer_size=buffer_size)
    share = split.fresh(epoch, consumers, per_unit, slot)
    return start_progress(split, epoch, consumers, per_unit, slot, share, buffer_size=buffer_size)


def _elastic(
    split: EpochSplit,
    epoch: int,
    pending: State,
    consumer: Consumer,
    checker: Checker,
    *,
    buffer_size: int,
) -> Progress:
    """``consumer``'s share of what the job state ``pending`` left undelivered."""
    slot, consumers, per_unit = consumer.slot, consumer.consumers, consumer.per_unit
    before = checker.elastic(pending, loud=slot == 0)
    pieces, digest = leftover(pending, plan_for(split, epoch))
    share = split.share(pieces, consumers, per_unit, slot, epoch)
    logger.info(
        "epoch %d resumed elastically: %d undelivered samples split between %d "
        "consumers, %d to this one (consumer %d, %d of them repeated)",
        epoch,
        sum(len(split.run_of(p)) for p in pieces),
        consumers,
        share.samples,
        slot,
        share.repeated,
    )
    progress = start_progress(
        split, epoch, consumers, per_unit, slot, share, buffer_size=buffer_size, carried=digest
    )
    progress.prior = carried(before)
    progress.seen = None if before is None else Tally()
    return progress


def log_sizes(progress: Progress) -> None:
    """The line that announces a consumer's epoch (INFO for consumer 0, DEBUG for the rest)."""
    sizes = progress.sizes
    log = logger.info if progress.slot == 0 else logger.debug
    if progress.carried is not None:
        log(
            "epoch %d (resumed): consumer %d of %d reads %d samples, %d of them repeated",
            progress.epoch,
            progress.slot,
            progress.consumers,
            sizes.get("own", 0),
            sizes.get("own_repeated", 0),
        )
        return
    samples = sizes.get("samples", 0)
    asked = sizes.get("epoch_size", samples)
    log(
        "epoch %d: %s samples, %d for each of %d consumers (%d per cache); %d repeated, %d dropped",
        progress.epoch,
        samples if asked == samples else f"epoch_size {asked} of {samples}",
        sizes.get("per_consumer", 0),
        progress.consumers,
        progress.per_unit,
        sizes.get("repeated", 0),
        sizes.get("dropped", 0),
    )
