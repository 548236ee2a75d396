"""The resume state: what one consumer has delivered, as plain JSON, versioned and checked.

A consumer state records the epoch and its layout (how many consumers, how many of them
share a cache, and whether the epoch was itself resumed from leftovers), the consumer's
slot and plan, where in the plan the next sample starts (piece, samples of it taken, byte
offset, key), the shuffle buffer's samples (by shard, offset and key: their bytes are read
again on resume) and its draw counter, and the epoch's sizes (samples per consumer,
repeated and dropped), and what it delivered as a tally (``seen``: a digest and a count,
:mod:`shardcache._datasets.delivery_digest`; a state written before tallies existed has
none, and its epoch is not checked), the tally of the samples of its plan a handler
skipped (``skipped``) and, after an elastic resume, the job's tallies of the epoch before
it (``prior``: seen, skipped and expected, the same in every consumer). A sample
counts as delivered once it left the dataset's iterator; samples in the shuffle buffer,
or read ahead anywhere else, do not.

A *job state* gathers the consumer states of every rank and worker
(:func:`job_state`); from it any layout can resume: the same one exactly, another one by
redistributing the leftover pieces (:func:`leftover`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._base.errors import ResumeError
from .delivery_digest import Tally
from .resume_plan import Piece

FORMAT = "shardcache.resume"
MIXTURE_FORMAT = "shardcache.mixture"  # a MixtureDataset's state: one of these per source
MIXTURE_VERSION = 4  # 4: sources walk on over epochs; 3: schedule recorded; 2: split together
VERSION = 4  # 4: whole shards handed out by count; 3: by samples; 2: contiguous spans
State = dict[str, Any]
# A fresh epoch's plan of a consumer: (consumers, consumers per cache, slot) -> pieces.
PlanFor = Callable[[int, int, int], list[Piece]]


@dataclass(frozen=True)
class DatasetIdentity:
    """What a state is only valid for: the shard list and the order's parameters."""

    shards: int
    digest: str
    first: str
    last: str
    seed: int
    shuffle_shards: bool
    remainder: str
    epoch_size: int | None = None
    shuffle_scope: str = "cache"

    @classmethod
    def of(
        cls,
        urls: Sequence[str],
        seed: int,
        shuffle_shards: bool,
        remainder: str,
        epoch_size: int | None = None,
        *,
        shuffle_scope: str = "cache",
    ) -> DatasetIdentity:
        digest = hashlib.sha256("\n".join(urls).encode()).hexdigest()[:32]
        return cls(
            len(urls),
            digest,
            urls[0],
            urls[-1],
            seed,
            shuffle_shards,
            remainder,
            epoch_size,
            shuffle_scope,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "shards": self.shards,
            "digest": self.digest,
            "first": self.first,
            "last": self.last,
            "seed": self.seed,
            "shuffle_shards": self.shuffle_shards,
            "remainder": self.remainder,
            "epoch_size": self.epoch_size,
            "shuffle_scope": self.shuffle_scope,
        }

    def check(self, state: Mapping[str, Any]) -> None:
        """Refuse a state of another format, version, dataset, shard list or order."""
        if not isinstance(state, Mapping) or state.get("format") != FORMAT:
            seen = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ResumeError(
                f"not a shardcache resume state (format {seen!r}, expected {FORMAT!r}); pass "
                "what ResumableDataset.state_dict() or shardcache.job_state() returned",
                expected=FORMAT,
                seen=seen,
            )
        if state.get("version") != VERSION:
            raise ResumeError(
                f"resume state version {state.get('version')!r} cannot be read by this "
                f"shardcache (it reads version {VERSION}); resume with the shardcache "
                "version that wrote it, or start the epoch again",
                expected=VERSION,
                seen=state.get("version"),
            )
        theirs = state.get("dataset") or {}
        mine = self.as_json()
        if theirs.get("digest") != self.digest:
            raise ResumeError(
                f"the state was taken over another shard list ({theirs.get('shards')} shards, "
                f"{theirs.get('first')!r} .. {theirs.get('last')!r}) than this dataset's "
                f"({self.shards} shards, {self.first!r} .. {self.last!r}); resume with the "
                "shard list the state was taken with",
                what="shard list",
                expected=mine,
                seen=theirs,
            )
        for name in ("seed", "shuffle_shards", "remainder", "epoch_size", "shuffle_scope"):
            seen = theirs.get(name, "cache" if name == "shuffle_scope" else None)  # older states
            if seen != mine[name]:
                raise ResumeError(
                    f"the state was taken with {name}={seen!r}; this dataset has "
                    f"{name}={mine[name]!r}: the epoch's order would differ. Resume with "
                    f"{name}={seen!r}",
                    what=name,
                    expected=mine[name],
                    seen=seen,
                )


@dataclass
class Progress:
    """A consumer's place in its epoch (mutated by the reading loop as samples leave)."""

    epoch: int
    consumers: int
    per_unit: int  # consumers that share a cache (a rank's workers, or a node's)
    slot: int
    plan: list[Piece]
    carried: str | None = None  # digest of the leftover a resumed epoch was dealt from
    sizes: dict[str, int] = field(default_factory=dict)  # the epoch's, job-wide and own
    layout: str = ""  # digest of the shards' sample counts the plan was made from
    item: int = 0  # the piece being read
    taken: int = 0  # samples of that piece already read
    offset: int = 0  # byte offset of the next sample in that piece's shard
    key: str | None = None  # that sample's key, when known
    buffer: list[tuple[int, int, str]] = field(default_factory=list)  # shard, offset, key
    buffer_size: int = 0
    draws: int = 0
    delivered: int = 0
    seen: Tally | None = field(default_factory=Tally)  # None: unknown (an older state)
    skipped: Tally = field(default_factory=Tally)  # samples of the plan the handler skipped
    prior: dict[str, Any] | None = None  # the job's tallies before an elastic resume

    def as_json(self, identity: DatasetIdentity) -> State:
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": "consumer",
            "dataset": identity.as_json(),
            "epoch": self.epoch,
            "consumers": self.consumers,
            "per_unit": self.per_unit,
            "carried": self.carried,
            "sizes": dict(self.sizes),
            "layout": self.layout,
            "slot": self.slot,
            # A fresh epoch's plan follows from (epoch, consumers, slot): not stored.
            "plan": None if self.carried is None else [p.as_json() for p in self.plan],
            "item": self.item,
            "taken": self.taken,
            "offset": self.offset,
            "key": self.key,
            "buffer": [list(entry) for entry in self.buffer],
            "buffer_size": self.buffer_size,
            "draws": self.draws,
            "delivered": self.delivered,
            "seen": None if self.seen is None else self.seen.as_json(),
            "skipped": self.skipped.as_json(),
            "prior": self.prior,
        }

    @classmethod
    def from_json(cls, state: Mapping[str, Any], plan_for: PlanFor) -> Progress:
        consumers, slot = int(state["consumers"]), int(state["slot"])
        per_unit = int(state["per_unit"])
        if state.get("plan") is None:
            plan = plan_for(consumers, per_unit, slot)
        else:
            plan = [Piece.from_json(p) for p in state["plan"]]
        return cls(
            epoch=int(state["epoch"]),
            consumers=consumers,
            per_unit=per_unit,
            slot=slot,
            plan=plan,
            carried=state.get("carried"),
            sizes={k: int(v) for k, v in (state.get("sizes") or {}).items()},
            layout=str(state.get("layout", "")),
            item=int(state["item"]),
            taken=int(state.get("taken", 0)),
            offset=int(state["offset"]),
            key=state.get("key"),
            buffer=[(int(s), int(o), str(k)) for s, o, k in state.get("buffer", [])],
            buffer_size=int(state.get("buffer_size", 0)),
            draws=int(state.get("draws", 0)),
            delivered=int(state.get("delivered", 0)),
            seen=None if state.get("seen") is None else Tally.from_json(state["seen"]),
            skipped=Tally.from_json(state["skipped"]) if state.get("skipped") else Tally(),
            prior=state.get("prior"),
        )

    def left(self) -> list[Piece]:
        """What this consumer had not delivered: buffered samples, then the rest of the
        piece being read, then the pieces after it."""
        pieces = [Piece(shard, offset, 1) for shard, offset, _ in self.buffer]
        return pieces + self.ahead(len(self.plan))

    def ahead(self, upto: int) -> list[Piece]:
        """The samples from the position to piece ``upto``: the rest of the piece being
        read, then the pieces after it."""
        if self.item >= min(upto, len(self.plan)):
            return []
        current = self.plan[self.item]
        count = None if current.count is None else current.count - self.taken
        return [Piece(current.shard, self.offset, count), *self.plan[self.item + 1 : upto]]


def start_state(identity: DatasetIdentity, epoch: int) -> State:
    """A state that has delivered nothing of ``epoch`` (before iteration began)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "start",
        "dataset": identity.as_json(),
        "epoch": epoch,
    }


def _dataset_states(value: Any) -> Iterable[Mapping[str, Any]]:
    """The shardcache states inside ``value``: a state, a job state, a StatefulDataLoader
    ``state_dict()`` (its workers' or its own dataset state), or a list of these."""
    if isinstance(value, Mapping):
        if value.get("format") == MIXTURE_FORMAT:  # gathered per source by job_state()
            yield value
            return
        if value.get("format") == FORMAT:
            if value.get("kind") == "job":
                yield from value["parts"]
            else:
                yield value
            return
        snapshot = value.get("_snapshot")
        if isinstance(snapshot, Mapping):
            workers = snapshot.get("_worker_snapshots") or {}
            for worker in workers.values():
                yield from _dataset_states(worker.get("dataset_state"))
            main = snapshot.get("_main_snapshot") or {}
            if main.get("dataset_state") is not None:
                yield from _dataset_states(main["dataset_state"])
            return
        if "dataset_state" in value:  # a single-process StatefulDataLoader's snapshot
            yield from _dataset_states(value["dataset_state"])
            return
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _dataset_states(item)
        return
    if value is None:
        return
    raise ResumeError(
        f"cannot find a shardcache resume state in {type(value).__name__} {value!r:.120}; "
        "expected ResumableDataset.state_dict(), StatefulDataLoader.state_dict() or a list",
        seen=type(value).__name__,
    )


def job_state(*states: Any) -> State:
    """Gather the states of every rank (and worker) of a job into one that can resume any
    layout: same ranks and workers exactly, others elastically. Accepts dataset states,
    StatefulDataLoader ``state_dict()`` s, job states and lists of them (of a
    ``MixtureDataset``: gathered per source)."""
    found = list(_dataset_states(list(states)))
    if any(state.get("format") == MIXTURE_FORMAT for state in found):
        from .._base.extras import require_extras

        require_extras("shardcache.job_state of a MixtureDataset's states", "torch")
        return _mixture_job_state(found)
    parts: dict[int, State] = {}
    starts: list[State] = []
    for state in found:
        if state.get("format") != FORMAT:
            raise ResumeError(
                f"not a shardcache resume state: {state!r:.120}", expected=FORMAT, seen=state
            )
        if state.get("kind") == "start":
            starts.append(dict(state))
            continue
        slot = int(state["slot"])
        if slot in parts and _canonical(parts[slot]) != _canonical(state):
            raise ResumeError(
                f"two different states for consumer {slot} (of {state['consumers']}): the "
                "states come from different steps or jobs; gather each rank's state of one "
                "checkpoint",
                slot=slot,
            )
        parts[slot] = dict(state)
    every = [*parts.values(), *starts]
    if not every:
        raise ResumeError("job_state() was given no shardcache resume state", seen=states)
    first = every[0]
    for state in every[1:]:
        if state["dataset"] != first["dataset"]:
            raise ResumeError(
                "the states come from different datasets, shard lists or seeds: "
                f"{first['dataset']} and {state['dataset']}",
                expected=first["dataset"],
                seen=state["dataset"],
            )
        if state["epoch"] != first["epoch"]:
            raise ResumeError(
                f"the states are of different epochs ({first['epoch']} and {state['epoch']}); "
                "take every rank's state at the same step",
                expected=first["epoch"],
                seen=state["epoch"],
            )
    layouts = {(p["consumers"], p["per_unit"], p.get("carried")) for p in parts.values()}
    if len(layouts) > 1:
        raise ResumeError(
            f"the states come from different job layouts {sorted(layouts, key=str)} "
            "(consumers, consumers per cache, resumed-from): take every rank's state at the "
            "same step of one job",
            seen=sorted(layouts, key=str),
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": "job",
        "dataset": first["dataset"],
        "epoch": first["epoch"],
        "parts": [parts[slot] for slot in sorted(parts)] or starts[:1],
    }


def _mixture_job_state(states: Sequence[Mapping[str, Any]]) -> State:
    """Mixture states of every rank (and worker) gathered into one per source."""
    names = states[0]["sources"]
    for state in states:
        if state["sources"] != names:
            raise ResumeError(
                f"the states come from mixtures of different sources: {names} and "
                f"{state['sources']}; gather the states of one job",
                expected=names,
                seen=state["sources"],
            )
    return {
        "format": MIXTURE_FORMAT,
        "version": MIXTURE_VERSION,
        "sources": names,
        "schedule": states[0].get("schedule"),  # the epoch's (job_state checks one epoch)
        "states": [job_state([s["states"][i] for s in states]) for i in range(len(names))],
    }


def _canonical(state: Mapping[str, Any]) -> str:
    return json.dumps(state, sort_keys=True)


def leftover(job: Mapping[str, Any], plan_for: PlanFor) -> tuple[list[Piece], str]:
    """Every piece the job's consumers had not delivered, in slot order, and a digest that
    names this leftover (it seeds the resumed epoch and tags its states)."""
    parts = [p for p in job["parts"] if p.get("kind") == "consumer"]
    if not parts:
        return [], ""
    consumers, carried = int(parts[0]["consumers"]), parts[0].get("carried")
    per_unit = int(parts[0]["per_unit"])
    by_slot = {int(p["slot"]): p for p in parts}
    pieces: list[Piece] = []
    for slot in range(consumers):
        state = by_slot.get(slot)
        if state is not None:
            pieces += Progress.from_json(state, plan_for).left()
        elif carried is None:  # delivered nothing of a fresh epoch: its whole plan is left
            pieces += plan_for(consumers, per_unit, slot)
        else:
            raise ResumeError(
                f"the job state lacks consumer {slot} of {consumers}, and that epoch was "
                "itself resumed, so its plan is not known; gather the states of every rank "
                "(StatefulDataLoader.state_dict() of each) of one checkpoint",
                slot=slot,
                consumers=consumers,
            )
    digest = hashlib.sha256(
        json.dumps([consumers, carried, [p.as_json() for p in pieces]]).encode()
    ).hexdigest()[:32]
    return pieces, digest
