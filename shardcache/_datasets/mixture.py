"""A mixture of sources: several shard lists read at set proportions, resumable.

::

    dataset = shardcache.MixtureDataset(
        [
            shardcache.Source("s3://web/{000000..000999}.tar", weight=0.7, name="web"),
            shardcache.Source("s3://code/{000000..000099}.tar", weight=0.3, name="code"),
        ],
        epoch_size=1_000_000,
        seed=0,
    )

Each source is a :class:`~shardcache._datasets.resumable.ResumableDataset` of its own with the
epoch size the mixture gives it (``samples=``, or its ``weight``'s share of
``epoch_size``), so each keeps what that dataset guarantees: a sample-level split, each
shard read by the same cache in every epoch, exact and elastic resume; and each source
walks on through its samples over epochs, each cache's window starting where its reads
of the epochs before left it, however the counts changed (one cache: no sample comes
again before every other came as often). The sources are
split between the consumers (rank x DataLoader worker) together
(:func:`~shardcache._datasets.epoch_split.consumer_counts`): every consumer the same
total, a source's counts differing by at most one between consumers, exactly the counts
asked when the consumers divide the epoch. Each consumer then interleaves its sources
sample by sample (:func:`~shardcache._datasets.interleave.next_source`) by its own
counts: every prefix of its stream holds each source less than one sample off its
proportion, so every batch less than two, and a
window of ``N`` global batches (``R`` ranks of ``W`` workers) less than
``3 * R * min(N, W)`` off the epoch's proportions (a consumer's counts are less than a
sample a source off its even part).

Weights may change per epoch and in steps within an epoch (``schedule``,
:mod:`~shardcache._datasets.mixture_schedule`): an epoch's steps are split between the
consumers together, one after another, and each consumer mixes step by step
(:func:`~shardcache._datasets.interleave.stepped_picks`).

The state is every source's state and the schedule at its epoch; an elastic resume gathers
them per source (``shardcache.job_state``, in ``_datasets.resume_state``). A state is
refused (:class:`ResumeError`) when the sources, their names or shard lists differ, or its
epoch's schedule (naming the first difference): a change no schedule describes starts a
new epoch rather than mixing two plans.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils.data
import webdataset as wds

from .._base.errors import ConfigError, ResumeError, ShardCacheError
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._observe import metrics
from .delivery_check import DeliveryCheck
from .delivery_digest import BATCH
from .epoch_split import Lay
from .fluent import Fluent
from .interleave import Stored, order, stepped_picks
from .mixture_schedule import (
    MixtureSchedule,
    Schedule,
    Steps,
    checked_weight,
    epoch_counts,
    split_by,
)
from .resumable import ResumableDataset, Stage
from .resume_options import whole
from .resume_state import MIXTURE_FORMAT, MIXTURE_VERSION, State, job_state
from .urls import Spec
from .wds import Handler

logger = get_logger(__name__)

FORMAT = MIXTURE_FORMAT
VERSION = MIXTURE_VERSION


@dataclass(frozen=True)
class Source:
    """One shard list of a mixture and what it gets each epoch: ``weight`` (a share of the
    mixture's ``epoch_size``) or ``samples`` (a count), exactly one. ``name`` tags its
    samples (``"__source__"``) and errors; ``index`` is its sample index file, ``lock``
    its dataset lockfile (``ResumableDataset``'s ``lock``)."""

    urls: Spec
    weight: float | None = None
    samples: int | None = None
    name: str | None = None
    index: str | None = None
    lock: str | None = None


class MixtureDataset(Fluent, torch.utils.data.IterableDataset):
    """Samples of several :class:`Source` s at set proportions (each sample tagged
    ``"__source__"``), resumable exactly and elastically. ``epoch_size`` is the samples an
    epoch (needed with weights); ``schedule`` changes the weights per epoch and within
    epochs (:mod:`~shardcache._datasets.mixture_schedule`); the other arguments are
    :class:`ResumableDataset`'s, for every source. ``len()`` is the samples this rank
    yields in the epoch read next, with the DataLoader workers given to
    ``prepare(workers=)`` (:mod:`~shardcache._datasets.fluent`)."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        epoch_size: int | None = None,
        seed: int = 0,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 0,
        remainder: str = "pad",
        shuffle_scope: str = "cache",
        handler: Handler = wds.reraise_exception,
        cache: ShardCache | None = None,
        threads: int | None = None,
        depth: int | None = None,
        stall_timeout: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shards_changed: str | None = None,
        schedule: Schedule | None = None,
    ) -> None:
        super().__init__()
        given = _checked(sources, scheduled=schedule is not None)
        if epoch_size is not None:
            epoch_size = whole("epoch_size", epoch_size, low=1)
        # With a schedule every source stays (weight 0 now, it may join later): 1 keeps it.
        counts = [1] * len(given) if schedule is not None else epoch_counts(given, epoch_size)
        if not any(counts):
            raise ConfigError(
                "the mixture gets no sample an epoch: every source has samples=0 or a "
                "weight whose share rounds to 0; raise epoch_size or the counts",
                name="epoch_size",
                value=epoch_size,
            )
        for i, (source, count) in enumerate(zip(given, counts, strict=True)):
            if count == 0:
                logger.warning("source %r gets no sample an epoch: left out", _name(source, i))
        live = [i for i, count in enumerate(counts) if count > 0]
        self.sources = [given[i] for i in live]
        self.names = [_name(given[i], i) for i in live]
        self._schedule = MixtureSchedule(
            self.names,
            [s.weight for s in self.sources],
            [counts[i] for i in live],
            (epoch_size, remainder),
            schedule,
        )
        self._parts: list[ResumableDataset] = []
        for name, source in zip(self.names, self.sources, strict=True):
            with _naming(name):
                self._parts.append(
                    ResumableDataset(
                        source.urls,
                        seed=seed,
                        shuffle_shards=shuffle_shards,
                        shuffle_buffer=shuffle_buffer,
                        remainder=remainder,
                        shuffle_scope=shuffle_scope,
                        index=source.index,
                        handler=handler,
                        cache=cache,
                        threads=threads,
                        depth=depth,
                        stall_timeout=stall_timeout,
                        rank=rank,
                        world_size=world_size,
                        lock=source.lock,
                        shards_changed=shards_changed,
                    )
                )
        for name, part in zip(self.names, self._parts, strict=True):
            part._source = name  # its samples count for the source; the mixture ends epochs
            part._fold_at = max(1, BATCH // len(self._parts))  # as many held as one source
        self._stages: list[Stage] = []
        self._orders: dict[tuple[int, ...], bytes] = {}  # interleavings made by prepare()
        self._workers: int | None = None  # prepare()'s: the orders follow the epoch's weights
        self._prepared: tuple[int, ...] | None = None  # the lay the orders were made for
        # An elastically resumed epoch's leftover of each step (recorded in its states), of
        # which (epoch, carried), and the one a loaded job state deals next.
        self._left: Steps | None = None
        self._left_of: tuple[int, str | None] | None = None
        self._next_left: Steps | None = None
        self._enter(0)
        self._name_sources()

    @property
    def counts(self) -> list[int]:
        """The samples each source gets in the epoch read next (over its steps)."""
        steps = self._schedule.steps(self._parts[0].epoch)
        return [sum(counts) for counts in zip(*(step.counts for step in steps), strict=True)]

    def _enter(self, epoch: int) -> None:
        """Give every source epoch ``epoch``'s counts (the sources and steps split between
        consumers together), and with prepare(workers=) the workers' orders for them."""
        lay = self._schedule.lay(epoch)
        for i, part in enumerate(self._parts):
            part._lay = Lay(lay, i, len(self._parts), self._schedule.lay)
        if self._workers is not None and self._prepared != lay:
            self._orders = {}
            slots, consumers, per_unit = self._parts[0].worker_slots(self._workers)
            for slot in slots:
                for shares in self._schedule.consumer_steps(lay, (consumers, per_unit, slot)):
                    kept = order(shares)
                    if kept is not None:
                        self._orders[tuple(shares)] = kept
            self._prepared = lay

    def compose(self, *stages: Stage) -> MixtureDataset:
        """Append pipeline stages run on the mixed stream (as ``ResumableDataset``'s)."""
        for stage in stages:
            if not callable(stage):
                raise TypeError(f"a stage must be callable, not {stage!r:.80}")
        self._stages.extend(stages)
        return self

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next, in every source."""
        for name, part in zip(self.names, self._parts, strict=True):
            with _naming(name):
                part.set_epoch(epoch)
        self._enter(epoch)

    def prepare(self, workers: int | None = None) -> MixtureDataset:
        """Every source's :meth:`ResumableDataset.prepare`; with ``workers`` (the
        DataLoader's ``num_workers``) also the interleaving of each of this rank's workers,
        computed here once and handed to the workers (forked or spawned) with the dataset,
        instead of computed by the first epoch's workers (and kept in the cache root)."""
        for name, part in zip(self.names, self._parts, strict=True):
            with _naming(name):
                part.prepare()
        if workers is not None:
            self._workers, self._prepared = whole("workers", workers, low=0), None
            self._enter(self._parts[0].epoch)
        return self

    def _resumables(self) -> list[Any]:
        return list(self._parts)

    def cache_urls(self) -> list[str]:
        """The shards this process's cache reads in every epoch, of every source."""
        return [url for part in self._parts for url in part.cache_urls()]

    def state_dict(self) -> State:
        """Every source's state (plain JSON), as :meth:`ResumableDataset.state_dict`."""
        states = [part.state_dict() for part in self._parts]
        epoch = int(states[0]["epoch"])
        record = self._schedule.record(epoch)
        if self._left is not None and self._left_of is not None and self._left_of[0] == epoch:
            record["left"] = self._left  # what the running epoch was dealt from
        return {
            "format": FORMAT,
            "version": VERSION,
            "sources": self.names,
            "schedule": record,
            "states": states,
        }

    def check_delivery(
        self, *states: Any, epoch_end: bool = False, on_mismatch: str | None = None
    ) -> dict[str, DeliveryCheck | None]:
        """Every source's :meth:`ResumableDataset.check_delivery` over ``states`` (every
        rank's ``StatefulDataLoader.state_dict()``, gathered), by source name."""
        job = job_state(*states)
        sources = _source_states(job, self.names)
        checks = {}
        for name, part, part_state in zip(self.names, self._parts, sources, strict=True):
            with _naming(name):
                checks[name] = part.check_delivery(
                    part_state, epoch_end=epoch_end, on_mismatch=on_mismatch
                )
        return checks

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume every source from ``state`` (a consumer's, or ``shardcache.job_state``'s);
        its epoch's schedule must be this mixture's (:class:`ResumeError` names the first
        difference)."""
        states = _source_states(state, self.names)
        record = state.get("schedule")
        self._schedule.check(record)
        epoch = int(record["epoch"])
        self._enter(epoch)
        self._left = record.get("left")
        first = states[0].get("parts", [{}])[0] if states[0].get("kind") == "job" else states[0]
        self._left_of = (epoch, first.get("carried"))
        jobs = [s for s in states if s.get("kind") == "job"]
        self._next_left = None
        if len(jobs) == len(states):  # an elastic resume deals each step's leftover
            self._next_left = self._schedule.job_leftover(epoch, jobs, self._left)
        for name, part, part_state in zip(self.names, self._parts, states, strict=True):
            with _naming(name):
                part.load_state_dict(part_state)

    def _steps_now(self, shares: list[int]) -> Steps:
        """This consumer's samples of each source in each step of the running epoch."""
        progress = self._parts[0]._progress
        if progress is None:
            return [shares]
        dealt = [p._progress is not None and p._progress.carried is not None for p in self._parts]
        if not any(dealt):  # a fresh epoch, or one resumed exactly (not from a leftover)
            lay = self._schedule.lay(progress.epoch)
            where = (progress.consumers, progress.per_unit, progress.slot)
            return self._schedule.consumer_steps(lay, where)
        if self._left_of != (progress.epoch, progress.carried):  # dealt now from a job's
            self._left, self._left_of = self._next_left, (progress.epoch, progress.carried)
        return [shares] if self._left is None else split_by(self._left, shares)

    def _name_sources(self) -> None:
        """Count the cache's work on each source's shards for the source, in this process
        (called again in every iterating process: spawned workers do not inherit it)."""
        for name, part in zip(self.names, self._parts, strict=True):
            metrics.name_sources(name, part.urls)

    def __iter__(self) -> Iterator[Any]:
        self._name_sources()
        self._enter(self._parts[0].epoch)  # the epoch set, or the loaded state's
        streams = []
        for name, part in zip(self.names, self._parts, strict=True):
            with _naming(name):
                streams.append(iter(part))
        stream: Iterator[Any] = self._mixed(streams)
        for stage in self._stages:
            stream = stage(stream)
        return iter(stream)

    def _mixed(self, streams: list[Iterator[Any]]) -> Iterator[Any]:
        """The sources' samples in the picks' order (each source tags its own). A sample
        passes through C iterators only (``map``, ``next``), no Python frame of the
        mixture's own: the mixing costs a sample about what a generator layer would cost
        without its loop. The picks of a source that ended early (the handler left a shard
        out) and the end of the share are :meth:`_rest`'s."""
        shares, taken = [], []
        for part in self._parts:
            own, delivered = part.share_taken()
            shares.append(own)
            taken.append(delivered)
        stored = Stored(self._parts[0]._cache().layout)
        picks = stepped_picks(taken, self._steps_now(shares), self._orders, stored)
        # Stops at the picks' end, or at the first pick of a source that ended early.
        fast = map(next, map(streams.__getitem__, picks))
        return _Mixed(fast, self._rest(streams, picks), streams=streams)

    def _rest(self, streams: list[Iterator[Any]], picks: Iterator[int]) -> Iterator[Any]:
        """The picks left after a source ended early (none when every source lasts), each
        source's share-end check and the epoch's end; the sources' streams closed."""
        try:
            for i in picks:
                sample = next(streams[i], None)
                if sample is not None:  # None: that source ended early too
                    yield sample
            for stream in streams:
                # Its share is out: its stream ends as a lone dataset's does, after the
                # verdict of the shard it read last. Closed instead, that shard's download
                # (read while it landed) would be cancelled unpublished and fetched again.
                next(stream, None)  # a sample past the share: the delivery check counts it
            for name, part in zip(self.names, self._parts, strict=True):
                with _naming(name):
                    part._check_share_end()
        finally:
            for stream in streams:  # each counts the samples it delivered
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
        metrics.end_epoch()  # the epoch its sources set (metrics.set_epoch)


class _Mixed(itertools.chain):
    """The mixed stream: ``itertools.chain`` (its ``__next__`` in C) that can be closed as
    a generator, closing the sources' streams (each counts the samples it delivered)."""

    def __new__(cls, *parts: Iterator[Any], streams: list[Iterator[Any]]) -> _Mixed:
        mixed = super().__new__(cls, *parts)
        mixed._parts, mixed._streams = parts, streams
        return mixed

    def close(self) -> None:
        for stream in (*self._parts, *self._streams):
            close = getattr(stream, "close", None)
            if close is not None:
                close()


def _source_states(state: Mapping[str, Any], names: list[str]) -> list[Any]:
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        seen = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ResumeError(
            f"not a shardcache mixture state (format {seen!r}, expected {FORMAT!r}); pass "
            "what MixtureDataset.state_dict() or shardcache.job_state() returned",
            expected=FORMAT,
            seen=seen,
        )
    if state.get("version") != VERSION:
        raise ResumeError(
            f"mixture state version {state.get('version')!r} cannot be read by this "
            f"shardcache (it reads version {VERSION}); resume with the shardcache version "
            "that wrote it, or start the epoch again (do not load the state)",
            expected=VERSION,
            seen=state.get("version"),
        )
    if state.get("sources") != names:
        raise ResumeError(
            f"the state is of a mixture of the sources {state.get('sources')}, this one "
            f"has {names}: a changed mixture starts its epoch afresh (do not load the "
            "state) or resumes with the sources it was taken with",
            expected=names,
            seen=state.get("sources"),
        )
    return list(state["states"])


def _checked(sources: Sequence[Source], scheduled: bool = False) -> list[Source]:
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
        raise ConfigError(
            f"sources must be a non-empty list of shardcache.Source, not {sources!r:.80}",
            name="sources",
            value=sources,
        )
    for i, source in enumerate(sources):
        if not isinstance(source, Source):
            raise ConfigError(
                f"source {i} must be a shardcache.Source, not {source!r:.80}",
                name="sources",
                value=source,
            )
        _check_amount(source, _name(source, i))
    weights = [s.weight for s in sources if s.weight is not None]
    if weights and not any(weights) and all(s.samples is None for s in sources) and not scheduled:
        raise ConfigError(
            "every source has weight 0: the mixture would have no sample; give some "
            "source a positive weight",
            name="weight",
            value=0,
        )
    names = [_name(s, i) for i, s in enumerate(sources)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"source names must differ: {twice} given more than once (name= tells them "
            "apart in states, errors and samples)",
            name="name",
            value=twice[0],
        )
    return list(sources)


def _check_amount(source: Source, name: str) -> None:
    if (source.weight is None) == (source.samples is None):
        raise ConfigError(
            f"source {name!r}: give exactly one of weight= (a share of epoch_size) and "
            f"samples= (a count per epoch), not weight={source.weight!r}, "
            f"samples={source.samples!r}",
            name="weight",
            value=source.weight,
        )
    if source.weight is not None:
        checked_weight(source.weight, f"source {name!r}")
    elif (
        isinstance(source.samples, bool)
        or not isinstance(source.samples, int)
        or (source.samples < 0)
    ):
        raise ConfigError(
            f"source {name!r}: samples must be a whole number >= 0, not {source.samples!r}",
            name="samples",
            value=source.samples,
        )


def _name(source: Source, index: int) -> str:
    return source.name if source.name is not None else f"source-{index}"


@contextlib.contextmanager
def _naming(name: str) -> Iterator[None]:
    """Re-raise a shardcache error of one source with the source's name in front."""
    try:
        yield
    except ShardCacheError as exc:
        if "source" not in exc.details:
            exc.message = f"source {name!r}: {exc.message}"
            exc.args = (exc.message,)
            exc.details["source"] = exc.source = name
        raise
