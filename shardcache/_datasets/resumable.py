"""A sharded dataset read through the cache that resumes mid-epoch, exactly or elastically.

::

    dataset = shardcache.ResumableDataset(
        "s3://bucket/train-{000000..000127}.tar", seed=0, shuffle_buffer=1000
    ).compose(wds.decode("rgb"), wds.to_tuple("jpg", "cls"))
    loader = StatefulDataLoader(dataset, batch_size=64, num_workers=4)

Each epoch is split by samples between the job's *consumers* (rank x DataLoader worker),
every rank computing the same split (:mod:`shardcache._datasets.epoch_split`): every consumer gets
the same number of samples (the remainder padded by repeats, or dropped), so every rank
yields the same number of batches, and each shard is read by the same cache (rank, or
node) in every epoch while the order changes (:meth:`set_epoch`). The split needs each
shard's sample offsets: an index file (``index=``, made by ``shardcache index``) or
learned by fetching the shards through the cache before the first sample
(:mod:`shardcache._datasets.sample_index`). Each consumer reads its pieces through the WebDataset
cache stage (:class:`~shardcache._datasets.wds.CacheStage`: prefetch threads, reading while
downloading, the handler) and, optionally, a seeded shuffle buffer.

:meth:`state_dict` says exactly which samples left the dataset: the piece and byte offset
the next sample starts at, the samples in the shuffle buffer (shard, offset, key) and the
buffer's draw count. StatefulDataLoader keeps one per worker. Restoring seeks to the
offsets: nothing before them is read, let alone decoded. A state of all consumers
(:func:`~shardcache._datasets.resume_state.job_state`) also resumes with another world size or
worker count: the undelivered pieces are dealt out again, each sample exactly once.

Stages given to :meth:`compose` run after the state is counted, so they must pass or drop
each sample as it comes (decode, map, to_tuple, select); a stage that holds samples back
(``wds.shuffle``, ``wds.batched``) would hold samples the state counts as delivered:
use ``shuffle_buffer`` and the DataLoader's ``batch_size`` instead.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.utils.data
import webdataset as wds

from .._base.errors import ConfigError, ResumeError, ShardFormatError
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._config.settings import Settings
from .._observe import metrics
from ..distributed import rank_info
from .epoch_split import EpochSplit, Lay
from .resume_options import (
    flag,
    index_location,
    rank_and_world_size,
    remainder_rule,
    resumable_urls,
    whole,
)
from .resume_pieces import advance, piece_samples, visits
from .resume_plan import RandomDraws
from .resume_start import check_layout, check_same_consumer, finished, plan_for, start_progress
from .resume_state import DatasetIdentity, Progress, State, job_state, leftover, start_state
from .sample_index import SampleIndex, learn, load_index
from .shuffle_buffer import ShuffleBuffer, restore_ranged, seeked
from .urls import Spec
from .wds import CacheStage, Handler

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
        self.urls = resumable_urls(urls)
        self.seed = whole("seed", seed, low=0)
        self.shuffle_buffer = whole("shuffle_buffer", shuffle_buffer, low=0)
        self.shuffle_shards = flag("shuffle_shards", shuffle_shards)
        self.remainder = remainder_rule(remainder)
        self.epoch_size = None if epoch_size is None else whole("epoch_size", epoch_size, low=1)
        self.index = index_location(index)
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
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
        self._lay: Lay | None = None  # a mixture's counts, split together (MixtureDataset sets it)

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
            if not (self._pending_entered or finished(pending, self._epoch_split())):
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

    # -- the sample index and the split ----------------------------------------------

    def prepare(self) -> ResumableDataset:
        """Load or learn the shards' sample offsets, and hand the shards out to the
        caches, now, in this process (DataLoader workers forked afterwards inherit both
        instead of each reading the index and computing the hand-out)."""
        _, world_size, local_world_size = self._ranks()
        per_cache = self._ranks_per_cache(world_size, local_world_size)
        self._epoch_split().unit_shares(world_size // per_cache)
        return self

    def worker_slots(self, workers: int) -> tuple[range, int, int]:
        """The consumer slots of this rank's ``workers`` DataLoader workers (0: none, the
        rank reads), the job's consumers and how many of them share a cache."""
        workers = max(1, workers)
        rank, world_size, local_world_size = self._ranks()
        per_unit = self._ranks_per_cache(world_size, local_world_size) * workers
        return range(rank * workers, (rank + 1) * workers), world_size * workers, per_unit

    def _epoch_split(self) -> EpochSplit:
        if self._split is None:
            self._samples = self._sample_index()
            self._split = EpochSplit(
                [self._samples[url].starts for url in self.urls],
                seed=self.seed,
                shuffle=self.shuffle_shards,
                remainder=self.remainder,
                epoch_size=self.epoch_size,
                lay=self._lay,
            )
            empty = [url for url in self.urls if self._samples[url].count == 0]
            if empty:
                logger.warning(
                    "%d of %d shards hold no sample and are left out (first: %s)",
                    len(empty),
                    len(self.urls),
                    empty[0],
                )
        elif self._lay is not None and self._split.lay != self._lay:  # a mixture's new weights
            self._split = self._split.relaid(self._lay)
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

    def _progress_for(
        self, pending: State | None, slot: int, consumers: int, per_unit: int
    ) -> Progress:
        epoch = self.epoch if pending is None else int(pending["epoch"])
        split = self._epoch_split()
        plan = plan_for(split, epoch)
        if pending is not None and pending["kind"] != "start":
            check_layout(pending, split)
        if pending is not None and pending["kind"] == "consumer":
            check_same_consumer(pending, consumers, per_unit, slot)
            return Progress.from_json(pending, plan)
        if pending is not None and pending["kind"] == "job":
            parts = {p["slot"]: p for p in pending["parts"] if p["kind"] == "consumer"}
            same_layout = all(
                (p["consumers"], p["per_unit"]) == (consumers, per_unit) for p in parts.values()
            )
            if parts and same_layout and len(parts) == consumers:  # every consumer: exact
                return Progress.from_json(parts[slot], plan)
            if parts:
                pieces, digest = leftover(pending, plan)
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
                return start_progress(
                    split,
                    epoch,
                    consumers,
                    per_unit,
                    slot,
                    share,
                    buffer_size=self.shuffle_buffer,
                    carried=digest,
                )
        share = split.fresh(epoch, consumers, per_unit, slot)
        return start_progress(
            split, epoch, consumers, per_unit, slot, share, buffer_size=self.shuffle_buffer
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
            for opened in self._stage.opened(visits(self.urls, progress, ranged)):
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
                    advance(progress, item)
                try:
                    for sample in piece_samples(
                        progress, opened, self._samples, self._epoch_split()
                    ):
                        if (out := shuffler.add(sample)) is not None:
                            progress.delivered += 1
                            yield out
                except ShardFormatError as exn:
                    if not self._stage.handler(exn):
                        return
                if progress.item == item:  # an empty piece, or one the handler gave up on
                    advance(progress, item + 1)
                # Counted once a piece, not once a sample.
                metrics.count(samples=progress.delivered - delivered, source=self._source)
                delivered = progress.delivered
            shuffler.drop_unrestored()
            advance(progress, len(progress.plan))
            while (out := shuffler.drain_one()) is not None:
                progress.delivered += 1
                yield out
        finally:  # what was yielded since the last count (a mixture stops at its share)
            metrics.count(samples=progress.delivered - delivered, source=self._source)
        if self._source is None:  # a mixture's source: the mixture closes the epoch
            metrics.end_epoch(progress.epoch)

    def _cache(self) -> ShardCache:
        return self._stage.cache if self._stage.cache is not None else ShardCache.from_env()


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
