"""Where a consumer's iteration starts: a fresh epoch's share, its own loaded state, or a
share of what a job state left undelivered; and the checks a loaded state passes first.

A state resumes only over the sample layout it was taken with (the shards' sample counts),
and a consumer's own state only in the same consumer (slot, count, cache sharing): anything
else is a ``ResumeError`` saying how to resume instead.
"""

from __future__ import annotations

from collections.abc import Callable

from .._base.errors import ResumeError
from .epoch_split import EpochSplit, Share
from .resume_plan import Piece
from .resume_state import Progress, State, leftover


def plan_for(split: EpochSplit, epoch: int) -> Callable[[int, int, int], list[Piece]]:
    """The plan of ``(consumers, per_unit, slot)`` in a fresh ``epoch`` of ``split``."""
    return lambda consumers, per_unit, slot: split.fresh(epoch, consumers, per_unit, slot).pieces


def finished(state: State, split: EpochSplit) -> bool:
    """Whether a loaded state has nothing left to deliver of its epoch."""
    plan = plan_for(split, int(state["epoch"]))
    if state.get("kind") == "job":
        return not leftover(state, plan)[0] and any(p["kind"] == "consumer" for p in state["parts"])
    return state.get("kind") == "consumer" and not Progress.from_json(state, plan).left()


def check_layout(state: State, split: EpochSplit) -> None:
    """Refuse a state taken over other sample counts than ``split``'s."""
    parts = state["parts"] if state["kind"] == "job" else [state]
    for part in parts:
        if part.get("kind") == "consumer" and part.get("layout") != split.digest:
            raise ResumeError(
                "the state was taken over shards holding other numbers of samples than "
                "this dataset's sample index gives (sample layout "
                f"{part.get('layout')!r}, now {split.digest!r}): the shards or the index "
                "changed. Resume with the shards and index the state was taken with, or "
                "start the epoch again",
                what="sample layout",
                expected=split.digest,
                seen=part.get("layout"),
            )


def check_same_consumer(pending: State, consumers: int, per_unit: int, slot: int) -> None:
    """Refuse a consumer's own state loaded into another consumer (or layout)."""
    if (pending["consumers"], pending["per_unit"], pending["slot"]) != (
        consumers,
        per_unit,
        slot,
    ):
        raise ResumeError(
            f"this state is consumer {pending['slot']} of {pending['consumers']} "
            f"({pending['per_unit']} per cache), but it is loaded into consumer {slot} "
            f"of {consumers} ({per_unit} per cache): a worker's own state resumes only "
            "the same world size, num_workers and cache scope. To resume with others, "
            "gather every rank's state with shardcache.job_state(...) and load that "
            "into the dataset",
            expected=[consumers, per_unit, slot],
            seen=[pending["consumers"], pending["per_unit"], pending["slot"]],
        )


def start_progress(  # noqa: PLR0917
    split: EpochSplit,
    epoch: int,
    consumers: int,
    per_unit: int,
    slot: int,
    share: Share,
    *,
    buffer_size: int,
    carried: str | None = None,
) -> Progress:
    """The progress of a consumer at the start of ``share`` (``carried``: the digest of the
    leftover it was cut from, when resumed elastically)."""
    sizes = split.totals(consumers, per_unit) if carried is None else {}
    sizes.update(own=share.samples, own_repeated=share.repeated)
    return Progress(
        epoch,
        consumers,
        per_unit,
        slot,
        share.pieces,
        carried=carried,
        sizes=sizes,
        layout=split.digest,
        offset=share.pieces[0].start if share.pieces else 0,
        buffer_size=buffer_size,
    )


__all__ = ["check_layout", "check_same_consumer", "finished", "plan_for", "start_progress"]
