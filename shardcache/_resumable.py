"""A sharded dataset read through the cache that resumes mid-epoch, exactly or elastically.

::

    dataset = shardcache.ResumableDataset(
        "s3://bucket/train-{000000..000127}.tar", seed=0, shuffle_buffer=1000
    ).compose(wds.decode("rgb"), wds.to_tuple("jpg", "cls"))
    loader = StatefulDataLoader(dataset, batch_size=64, num_workers=4)

Each epoch is split by samples between the job's *consumers* (rank x DataLoader worker),
every rank computing the same split (:mod:`shardcache._epoch_split`): every consumer gets
the same number of samples (the remainder padded by repeats, or dropped), so every rank
yields the same number of batches, and each shard is read by the same cache (rank, or
node) in every epoch while the order changes (:meth:`set_epoch`). The split needs each
shard's sample offsets: an index file (``index=``, made by ``shardcache index``) or
learned by fetching the shards through the cache before the first sample
(:mod:`shardcache._sample_index`). Each consumer reads its pieces through the WebDataset
cache stage (:class:`~shardcache._wds.CacheStage`: prefetch threads, reading while
downloading, the handler) and, optionally, a seeded shuffle buffer.

:meth:`state_dict` says exactly which samples left the dataset: the piece and byte offset
the next sample starts at, the samples in the shuffle buffer (shard, offset, key) and the
buffer's draw count. StatefulDataLoader keeps one per worker. Restoring seeks to the
offsets: nothing before them is read, let alone decoded. A state of all consumers
(:func:`~shardcache._resume_state.job_state`) also resumes with another world size or
worker count: the undelivered pieces are dealt out again, each sample exactly once.

Stages given to :meth:`compose` run after the state is counted, so they must pass or drop
each sample as it comes (decode, map, to_tuple, select); a stage that holds samples back
(``wds.shuffle``, ``wds.batched``) would hold samples the state counts as delivered:
use ``shuffle_buffer`` and the DataLoader's ``batch_size`` instead.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.utils.data
import webdataset as wds

from . import _metrics as metrics
from ._cache import ShardCache
from ._config import Settings
from ._epoch_split import REMAINDERS, EpochSplit, Share
from ._errors import ConfigError, ResumeError, ShardFormatError
from ._redact import get_logger
from ._resume_plan import Piece, RandomDraws
from ._resume_state import (
    DatasetIdentity,
    Progress,
    State,
    job_state,
    leftover,
    start_state,
)
from ._sample_index import SampleIndex, check_sample, learn, load_index, stale
from ._shuffle_buffer import ShuffleBuffer, buffered_by_shard, changed, restore_ranged, seeked
from ._tar_members import samples
from ._urls import Spec, expand_urls
from ._wds import STDIN_URL, CacheStage, Handler
from .distributed import rank_info

logger = get_logger(__name__)

Stage = Callable[[Iterator[Any]], Iterator[Any]]


class ResumableDataset(torch.utils.data.IterableDataset):
    """WebDataset samples (``{"__key__", "__url__", "__local_path__", suffix: bytes}``)
    of a shard list, read through the cache, with a resumable, deterministic epoch order.

    ``seed`` and the epoch (:meth:`set_epoch`) fix the shard order (``shuffle_shards``)
    and the shuffle buffer's draws (``shuffle_buffer`` samples; 0: none). Every consumer
    gets the same number of samples: ``remainder="pad"`` repeats samples to make up the
    rest, ``"drop"`` leaves it out. ``epoch_size`` (None: the shards' samples) sets how
    many samples an epoch has: fewer than the shards hold, and the next epochs deliver the
    rest first (each cache cycles through its own); more, and samples repeat.
    ``index`` is a sample index file (path or URL) made by
    ``shardcache index``; None learns it through the cache. ``rank`` and ``world_size``
    default to shardcache's detection (torch.distributed, torchrun, SLURM); DataLoader
    workers are found by ``torch.utils.data.get_worker_info()``. ``handler``, ``cache``,
    ``threads``, ``depth`` and ``stall_timeout`` are the WebDataset stage's.
    """

    def __init__(
        self,
        urls: Spec,
        *,
        seed: int = 0,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 0,
        remainder: str = "pad",
        epoch_size: int | None = None,
        index: str | None = None,
        handler: Handler = wds.reraise_exception,
        cache: ShardCache | None = None,
        threads: int | None = None,
        depth: int | None = None,
        stall_timeout: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        self.urls = expand_urls(urls)
        if STDIN_URL in self.urls:
            raise ConfigError(
                "ResumableDataset cannot read standard input ('-'): a resumable shard must "
                "be read again from an offset; put the data in a file or bucket",
                name="urls",
                value=STDIN_URL,
            )
        self.seed = whole("seed", seed, low=0)
        self.shuffle_buffer = whole("shuffle_buffer", shuffle_buffer, low=0)
        if not isinstance(shuffle_shards, bool):
            raise ConfigError(
                f"shuffle_shards must be True or False, not {shuffle_shards!r}",
                name="shuffle_shards",
                value=shuffle_shards,
            )
        self.shuffle_shards = shuffle_shards
        if remainder not in REMAINDERS:
            raise ConfigError(
                f"remainder must be one of {REMAINDERS}, not {remainder!r}: 'pad' repeats "
                "samples so that every consumer gets the same number, 'drop' leaves the rest "
                "out of the epoch",
                name="remainder",
                value=remainder,
            )
        self.remainder = remainder
        self.epoch_size = None if epoch_size is None else whole("epoch_size", epoch_size, low=1)
        if index is not None and not isinstance(index, (str, os.PathLike)):
            raise ConfigError(
                f"index must be a path or URL of a sample index file, not {index!r:.80}",
                name="index",
                value=index,
            )
        self.index = None if index is None else os.fspath(index)
        if (rank is None) != (world_size is None):
            raise ConfigError(
                "give both rank and world_size, or neither (then they are detected)",
                name="rank" if rank is None else "world_size",
                value=None,
            )
        if world_size is not None:
            world_size = whole("world_size", world_size, low=1)
            rank = whole("rank", rank, low=0)
            if rank >= world_size:
                raise ConfigError(
                    f"rank {rank} is not below world_size {world_size}",
                    name="rank",
                    value=rank,
                )
        self.rank, self.world_size = rank, world_size
        self.identity = DatasetIdentity.of(
            self.urls, self.seed, shuffle_shards, remainder, self.epoch_size
        )
        self.epoch = 0
        self._stage = CacheStage(
            handler, cache=cache, threads=threads, depth=depth, stall_timeout=stall_timeout
        )
        self._threads = threads
        self._samples: SampleIndex | None = None  # the shards' sample offsets, once known
        self._split: EpochSplit | None = None
        self._stages: list[Stage] = []
        self._epoch_chosen = False  # set_epoch() was called: a loaded state must agree
        self._pending: State | None = None  # loaded, applied when iteration starts
        self._pending_entered = False  # set_epoch() of the loaded state's epoch was called
        self._progress: Progress | None = None  # the running (or last) iteration's
        self._source: str | None = None  # the mixture source this is (MixtureDataset sets it)

    # -- configuration --------------------------------------------------------------

    def compose(self, *stages: Stage) -> ResumableDataset:
        """Append pipeline stages (``wds.decode(...)``, ``wds.to_tuple(...)``, any
        ``iterator -> iterator`` callable that passes or drops samples one by one)."""
        for stage in stages:
            if not callable(stage):
                raise TypeError(f"a stage must be callable, not {stage!r:.80}")
        self._stages.extend(stages)
        return self

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next (its own shard order and shuffle draws).

        A loaded state applies to its own epoch: ``set_epoch`` of that epoch keeps it (the
        next iteration, here or in DataLoader workers, resumes it), a later ``set_epoch``
        then moves on. Moving to another epoch straight after loading a state that still
        has samples to deliver is refused, so the rest of that epoch is not skipped by
        accident."""
        epoch = whole("epoch", epoch, low=0)
        pending = self._pending
        if pending is not None and pending["epoch"] == epoch:
            self._pending_entered = True
        elif pending is not None:
            if not (self._pending_entered or self._finished(pending)):
                raise ResumeError(
                    f"set_epoch({epoch}) after loading a state in the middle of epoch "
                    f"{pending['epoch']}: the rest of epoch {pending['epoch']} would be "
                    f"skipped; call set_epoch({pending['epoch']}) to finish it first",
                    expected=pending["epoch"],
                    seen=epoch,
                )
            self._pending = None
        if self._progress is not None and self._progress.epoch != epoch:
            self._progress = None
        self.epoch = epoch
        self._epoch_chosen = True

    # -- state ----------------------------------------------------------------------

    def state_dict(self) -> State:
        """This consumer's state (plain JSON). In the process that iterates: where the
        iteration stands; before it: the loaded state, or the start of the epoch."""
        if self._progress is not None:
            return self._progress.as_json(self.identity)
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        return start_state(self.identity, self.epoch)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state`` when iteration next starts: a consumer state (the same
        rank, worker and layout: exact), or a :func:`job_state` of every consumer (the
        same layout: exact; another: elastic). Raises :class:`ResumeError` for a state of
        another format version, dataset, shard list or seed."""
        self.identity.check(state)
        if state.get("kind") == "job":
            state = job_state(state)  # checks that its parts agree
            for part in state["parts"]:
                self.identity.check(part)
        if self._epoch_chosen and state["epoch"] != self.epoch:
            raise ResumeError(
                f"the state is of epoch {state['epoch']}, but set_epoch({self.epoch}) was "
                f"called; call set_epoch({state['epoch']}) to finish that epoch",
                expected=self.epoch,
                seen=state["epoch"],
            )
        self._pending = copy.deepcopy(dict(state))
        self._pending_entered = False
        self._progress = None
        self.epoch = int(state["epoch"])

    # -- iteration ------------------------------------------------------------------

    # -- the sample index and the split ----------------------------------------------

    def prepare(self) -> ResumableDataset:
        """Load or learn the shards' sample offsets, and hand the shards out to the
        caches, now, in this process (DataLoader workers forked afterwards inherit both
        instead of each reading the index and computing the hand-out)."""
        _, world_size, local_world_size = self._ranks()
        per_cache = self._ranks_per_cache(world_size, local_world_size)
        self._epoch_split().unit_shares(world_size // per_cache)
        return self

    def _epoch_split(self) -> EpochSplit:
        if self._split is None:
            self._samples = self._sample_index()
            self._split = EpochSplit(
                [self._samples[url].starts for url in self.urls],
                seed=self.seed,
                shuffle=self.shuffle_shards,
                remainder=self.remainder,
                epoch_size=self.epoch_size,
            )
            empty = [url for url in self.urls if self._samples[url].count == 0]
            if empty:
                logger.warning(
                    "%d of %d shards hold no sample and are left out (first: %s)",
                    len(empty),
                    len(self.urls),
                    empty[0],
                )
        return self._split

    def _sample_index(self) -> SampleIndex:
        if self.index is not None:
            return load_index(self.index, self.urls)
        cache = self._cache()
        threads = self._threads or cache.settings.threads
        logger.info(
            "learning the sample offsets of %d shards through the cache %s (%d threads); "
            "`shardcache index` makes an index file ahead (index=) to skip this",
            len(self.urls),
            cache.layout.scope_dir,
            threads,
        )
        return learn(self.urls, cache, threads=threads, handler=self._stage.handler)

    def share_taken(self) -> tuple[int, int]:
        """In the process that iterates: the samples this consumer gets in the running
        epoch and how many it has delivered (0, 0 before iterating)."""
        progress = self._progress
        if progress is None:
            return 0, 0
        return progress.sizes.get("own", 0), progress.delivered

    def cache_urls(self) -> list[str]:
        """The shards this process's cache (its rank's, or its node's at node scope) reads
        in every epoch: what to warm so that training makes no request."""
        rank, world_size, local_world_size = self._ranks()
        per_node = self._ranks_per_cache(world_size, local_world_size)
        owned = self._epoch_split().shard_units(world_size // per_node)[rank // per_node]
        return [self.urls[shard] for shard in owned]

    # -- iteration ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        in_worker = torch.utils.data.get_worker_info() is not None
        if in_worker and self._progress is not None:
            return _refuse_persistent_workers()  # raised from next(): the worker survives it
        slot, consumers, per_unit = self._consumer()
        pending, self._pending = self._pending, None
        progress = self._progress_for(pending, slot, consumers, per_unit)
        self._progress = progress
        stream: Iterator[Any] = self._delivered(progress)
        for stage in self._stages:
            stream = stage(stream)
        return iter(stream)

    def _ranks(self) -> tuple[int, int, int | None]:
        """This process's rank, the world size and the local world size (if known)."""
        if self.world_size is not None:
            assert self.rank is not None
            return self.rank, self.world_size, None
        ranks = rank_info()
        return ranks.rank, ranks.world_size, ranks.local_world_size

    def _ranks_per_cache(self, world_size: int, local_world_size: int | None) -> int:
        """How many ranks share a cache: a node's at node scope (when the node's size is
        known and divides the world), else 1."""
        if local_world_size is None or world_size % local_world_size:
            return 1
        cache = self._stage.cache
        scope = cache.settings.scope if cache is not None else Settings.resolve().scope
        return local_world_size if scope == "node" else 1

    def _consumer(self) -> tuple[int, int, int]:
        """This consumer's slot, the number of consumers, and how many share its cache."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world_size, local_world_size = self._ranks()
        per_unit = self._ranks_per_cache(world_size, local_world_size) * workers
        return rank * workers + worker, world_size * workers, per_unit

    def _plan_for(self, epoch: int) -> Callable[[int, int, int], list[Piece]]:
        split = self._epoch_split()
        return lambda consumers, per_unit, slot: (
            split.fresh(epoch, consumers, per_unit, slot).pieces
        )

    def _finished(self, state: State) -> bool:
        """Whether a loaded state has nothing left to deliver of its epoch."""
        plan_for = self._plan_for(int(state["epoch"]))
        if state.get("kind") == "job":
            return not leftover(state, plan_for)[0] and any(
                p["kind"] == "consumer" for p in state["parts"]
            )
        return state.get("kind") == "consumer" and not Progress.from_json(state, plan_for).left()

    def _progress_for(
        self, pending: State | None, slot: int, consumers: int, per_unit: int
    ) -> Progress:
        epoch = self.epoch if pending is None else int(pending["epoch"])
        split = self._epoch_split()
        plan_for = self._plan_for(epoch)
        if pending is not None and pending["kind"] != "start":
            self._check_layout(pending, split)
        if pending is not None and pending["kind"] == "consumer":
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
            return Progress.from_json(pending, plan_for)
        if pending is not None and pending["kind"] == "job":
            parts = {p["slot"]: p for p in pending["parts"] if p["kind"] == "consumer"}
            same_layout = all(
                (p["consumers"], p["per_unit"]) == (consumers, per_unit) for p in parts.values()
            )
            if parts and same_layout and len(parts) == consumers:  # every consumer: exact
                return Progress.from_json(parts[slot], plan_for)
            if parts:
                pieces, digest = leftover(pending, plan_for)
                share = split.share(pieces, consumers, per_unit, slot)
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
                return self._start(epoch, consumers, per_unit, slot, share, carried=digest)
        share = split.fresh(epoch, consumers, per_unit, slot)
        return self._start(epoch, consumers, per_unit, slot, share)

    def _start(  # noqa: PLR0917
        self,
        epoch: int,
        consumers: int,
        per_unit: int,
        slot: int,
        share: Share,
        carried: str | None = None,
    ) -> Progress:
        split = self._epoch_split()
        sizes = split.totals(consumers) if carried is None else {}
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
            buffer_size=self.shuffle_buffer,
        )

    @staticmethod
    def _check_layout(state: State, split: EpochSplit) -> None:
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

    def _delivered(self, progress: Progress) -> Iterator[dict[str, Any]]:
        """The consumer's samples in order; ``progress`` is kept true at every yield."""
        draws = RandomDraws(
            self.seed,
            progress.epoch,
            progress.carried or "",
            progress.consumers,
            progress.slot,
            draws=progress.draws,
        )
        shuffler = ShuffleBuffer(progress, draws)
        metrics.set_epoch(progress.epoch)
        if progress.item == 0 and progress.taken == 0 and not progress.buffer:
            _log_sizes(progress)
        delivered = progress.delivered
        try:
            ranged: set[int] = set()
            if progress.buffer and self._samples is not None:  # a resumed shuffle buffer
                ranged = restore_ranged(
                    progress, shuffler, self.urls, self._samples, self._cache(), self._threads
                )
            for opened in self._stage.opened(self._visits(progress, ranged)):
                kind, detail = opened["visit"]
                if kind == "buffer":
                    stream = opened["stream"]
                    shuffler.restore(
                        opened["url"],
                        opened.get("local_path"),
                        detail,
                        lambda offset, stream=stream: seeked(stream, offset),
                    )
                    continue
                shuffler.drop_unrestored()
                item = detail
                if progress.item < item:  # the handler skipped the pieces in between
                    logger.warning(
                        "pieces %d..%d of consumer %d were skipped by the handler",
                        progress.item,
                        item - 1,
                        progress.slot,
                    )
                    _advance(progress, item)
                try:
                    for sample in self._piece_samples(progress, opened):
                        if (out := shuffler.add(sample)) is not None:
                            progress.delivered += 1
                            yield out
                except ShardFormatError as exn:
                    if not self._stage.handler(exn):
                        return
                if progress.item == item:  # an empty piece, or one the handler gave up on
                    _advance(progress, item + 1)
                # Counted once a piece, not once a sample.
                metrics.count(samples=progress.delivered - delivered, source=self._source)
                delivered = progress.delivered
            shuffler.drop_unrestored()
            _advance(progress, len(progress.plan))
            while (out := shuffler.drain_one()) is not None:
                progress.delivered += 1
                yield out
        finally:  # what was yielded since the last count (a mixture stops at its share)
            metrics.count(samples=progress.delivered - delivered, source=self._source)
        if self._source is None:  # a mixture's source: the mixture closes the epoch
            metrics.end_epoch(progress.epoch)

    def _cache(self) -> ShardCache:
        return self._stage.cache if self._stage.cache is not None else ShardCache.from_env()

    def _visits(self, progress: Progress, skip: set[int]) -> Iterator[dict[str, Any]]:
        """Shards to open, in order: those of buffered samples (once each, but ``skip``),
        then those of the pieces left."""
        for shard, indices in buffered_by_shard(progress).items():
            if shard not in skip:
                yield {"url": self.urls[shard], "visit": ("buffer", indices)}
        for item in range(progress.item, len(progress.plan)):
            yield {"url": self.urls[progress.plan[item].shard], "visit": ("piece", item)}

    def _piece_samples(
        self, progress: Progress, opened: Mapping[str, Any]
    ) -> Iterator[dict[str, Any]]:
        """The samples of the piece being read, from ``progress.offset``; the position moves
        past each sample before it is handed on."""
        item = progress.item
        piece = progress.plan[item]
        stream, url = opened["stream"], opened["url"]
        stream.seek(progress.offset)
        expected = progress.key
        starts = self._samples[url].starts if self._samples is not None else None
        index = (
            None
            if starts is None
            else self._epoch_split().run_of(Piece(piece.shard, progress.offset)).first
        )
        for sample in samples(stream, progress.offset, url, only_one=piece.count == 1):
            if expected is not None and sample.key != expected:
                raise changed(url, sample.offset, expected, sample.key)
            expected = None
            progress.taken += 1
            if starts is not None and index is not None:
                check_sample(url, starts, index, sample)
                index += 1
            if sample.end < 0 or (piece.count is not None and progress.taken >= piece.count):
                _advance(progress, item + 1)
            else:
                progress.offset, progress.key = sample.end, sample.next_key
            yield {
                "position": (piece.shard, sample.offset, sample.key),
                "sample": sample.as_dict(url, opened.get("local_path")),
            }
            if progress.item != item:  # the piece is done (the shard may go on)
                return
        if progress.item == item and piece.count is not None:  # the shard ended too soon
            raise stale(url, f"{piece.count} samples from byte {piece.start}", progress.taken)


def _refuse_persistent_workers() -> Iterator[Any]:
    raise ConfigError(
        "ResumableDataset was iterated twice in one DataLoader worker: the workers are "
        "persistent (persistent_workers=True), and set_epoch() in the main process does not "
        "reach them, so every epoch would repeat the first one's order. Use "
        "persistent_workers=False (the default)",
        name="persistent_workers",
        value=True,
    )
    yield  # a generator: the error comes from the first next()


def _log_sizes(progress: Progress) -> None:
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


def _advance(progress: Progress, item: int) -> None:
    progress.item = item
    progress.offset = progress.plan[item].start if item < len(progress.plan) else 0
    progress.key = None
    progress.taken = 0


def whole(name: str, value: Any, *, low: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``low``, else a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(
            f"{name} must be a whole number >= {low}, not {value!r}", name=name, value=value
        )
    return value
