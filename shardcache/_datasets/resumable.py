"""A sharded dataset read through the cache that resumes mid-epoch, exactly or elastically.

::

    dataset = shardcache.ResumableDataset(
        "s3://bucket/train-{000000..000127}.tar", seed=0, shuffle_buffer=1000
    ).compose(wds.decode("rgb"), wds.to_tuple("jpg", "cls"))
    loader = StatefulDataLoader(dataset, batch_size=64, num_workers=4)

Each epoch is split by samples between the job's *consumers* (rank x DataLoader worker),
every rank computing the same split (:mod:`shardcache._datasets.epoch_split`): every
consumer gets the same number of samples (the remainder padded by repeats, or dropped), and
each shard is read by the same cache (rank, or node) in every epoch, or with
``shuffle_scope="global"`` dealt anew each epoch (:meth:`set_epoch`). The split needs each
shard's sample offsets: an index file (``index=``, made by ``shardcache index``), or
learned before the first sample with one read of each shard across the job, each cache
indexing its own shards, and kept for the next job (:mod:`shardcache._datasets.job_index`).
Each consumer reads its pieces through the WebDataset cache stage
(:class:`~shardcache._datasets.wds.CacheStage`: prefetch threads, reading while downloading,
the handler) and, optionally, a seeded shuffle buffer.

:meth:`state_dict` says exactly which samples left the dataset: the piece and byte offset
the next sample starts at, the samples in the shuffle buffer (shard, offset, key) and the
buffer's draw count. StatefulDataLoader keeps one per worker. Restoring seeks to the
offsets: nothing before them is read, let alone decoded. A state of all consumers
(:func:`~shardcache._datasets.resume_state.job_state`) also resumes with another world size or
worker count: the undelivered pieces are dealt out again, each sample exactly once.

Stages (:meth:`compose`, or :mod:`~shardcache._datasets.fluent`'s ``.decode()``, ``.batched()``...)
run after the state is counted: one that holds samples back (``wds.shuffle``, ``wds.batched``,
which reads one ahead) would hold samples the state counts as delivered.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.utils.data
import webdataset as wds

from .._base.errors import ResumeError, ShardFormatError
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._config.settings import Settings
from .._observe import metrics
from ..distributed import rank_info
from .dataset_lock import ShardIdentity
from .delivery_check import Checker, DeliveryCheck, mode_of, skipper
from .delivery_digest import BATCH, Recorder, SampleHasher
from .epoch_split import EpochSplit, Lay, scope_rule
from .fluent import Fluent
from .job_index import in_group, job_index, rank_part, serve_exchange, urls_digest
from .lock_check import LockUse
from .mesh_wiring import mesh_peers
from .resume_options import (
    flag,
    index_keeping,
    index_location,
    rank_and_world_size,
    refuse_persistent_workers,
    remainder_rule,
    resumable_urls,
    whole,
)
from .resume_pieces import advance, piece_samples, visits
from .resume_plan import RandomDraws
from .resume_progress import Consumer, log_sizes, progress_for
from .resume_start import finished
from .resume_state import DatasetIdentity, Progress, State, job_state, start_state
from .sample_index import SampleIndex, load_index
from .shuffle_buffer import ShuffleBuffer, restore_ranged, seeked
from .urls import Spec
from .wds import CacheStage, Handler

logger = get_logger(__name__)

Stage = Callable[[Iterator[Any]], Iterator[Any]]


class ResumableDataset(Fluent, torch.utils.data.IterableDataset):
    """WebDataset samples (``{"__key__", "__url__", "__local_path__", suffix: bytes}``)
    of a shard list, read through the cache, with a resumable, deterministic epoch order.

    ``seed`` and the epoch (:meth:`set_epoch`) fix the shard order (``shuffle_shards``)
    and the shuffle buffer's draws (``shuffle_buffer`` samples; 0: none). Every consumer
    gets the same number of samples: ``remainder="pad"`` repeats samples to make up the
    rest, ``"drop"`` leaves it out. ``epoch_size`` (None: the shards' samples) sets how
    many samples an epoch has: fewer than the shards hold, and the next epochs deliver the
    rest first (each cache cycles through its own); more, and samples repeat.
    ``shuffle_scope="global"`` deals the shards across the job anew each epoch (``"cache"``:
    each cache reads its own every epoch).
    ``index`` is a sample index file (path or URL) made by
    ``shardcache index``; None learns it (each cache its own shards, shared through
    torch.distributed when a process group is initialised, else through torchrun's or the
    SLURM step's store or ``SHARDCACHE_RENDEZVOUS_DIR``: see :meth:`prepare`) and keeps
    it in the cache root, and also beside the shards with ``keep_index="data"``. ``rank``
    and ``world_size`` default to shardcache's detection (torch.distributed, torchrun,
    SLURM); DataLoader workers are found by ``torch.utils.data.get_worker_info()``.
    ``handler``, ``cache``, ``threads``, ``depth``, ``stall_timeout``: the WebDataset stage's.
    ``lock`` is a dataset lockfile (path or URL; made from what the cache holds when it
    does not exist yet): every state records its digest, and the shards are checked
    against it before they are read (:mod:`shardcache._datasets.lock_check`); a shard
    that changed is read at its recorded version where the store keeps it, and otherwise
    raises :class:`~shardcache.DatasetChangedError` (``shards_changed="error"``) or is
    read as it is now with a warning (``"warn"``); None: ``SHARDCACHE_SHARDS_CHANGED``.
    With the cache mesh on (``SHARDCACHE_MESH``), only a dataset with a ``lock`` asks peers.
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
        shuffle_scope: str = "cache",
        index: str | None = None,
        keep_index: str = "cache",
        handler: Handler = wds.reraise_exception,
        cache: ShardCache | None = None,
        threads: int | None = None,
        depth: int | None = None,
        stall_timeout: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        lock: str | None = None,
        shards_changed: str | None = None,
    ) -> None:
        super().__init__()
        self.urls = resumable_urls(urls)
        self.seed = whole("seed", seed, low=0)
        self.shuffle_buffer = whole("shuffle_buffer", shuffle_buffer, low=0)
        self.shuffle_shards = flag("shuffle_shards", shuffle_shards)
        self.remainder = remainder_rule(remainder)
        self.epoch_size = None if epoch_size is None else whole("epoch_size", epoch_size, low=1)
        self.shuffle_scope = scope = scope_rule(shuffle_scope, self.shuffle_shards)
        self.index = index_location(index)
        self.keep_index = index_keeping(keep_index)
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
        self.identity = DatasetIdentity.of(
            self.urls, self.seed, shuffle_shards, remainder, self.epoch_size, shuffle_scope=scope
        )
        self.epoch = 0
        self._stage = CacheStage(
            handler, cache=cache, threads=threads, depth=depth, stall_timeout=stall_timeout
        )
        self._threads = threads
        self._lock = LockUse(lock, shards_changed)
        self._read_urls = self.urls  # the URLs read: a changed shard's pinned to its version
        self._samples: SampleIndex | None = None  # by read URL, once known
        self._split: EpochSplit | None = None
        self._stages: list[Stage] = []
        self._epoch_chosen = False  # set_epoch() was called: a loaded state must agree
        self._pending: State | None = None  # loaded, applied when iteration starts
        self._pending_entered = False  # set_epoch() of the loaded state's epoch was called
        self._progress: Progress | None = None  # the running (or last) iteration's
        self._source: str | None = None  # the mixture source this is (MixtureDataset sets it)
        self._lay: Lay | None = None  # a mixture's counts, split together (MixtureDataset sets it)
        self._recorder: Recorder | None = None  # the running iteration's delivered samples
        self._fold_at = BATCH  # positions folded at once (a mixture's sources share it)
        if self.index is None:  # SLURM task 0 without a process group serves the job's store
            serve_exchange(*self._ranks()[:2], cache)

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
        learn = self.index is None and self._split is None and in_group(*self._ranks()[:2])
        if self._split is None and (learn or self._settings().mesh):
            self._epoch_split()  # learned with the job's ranks (a collective); the mesh's offer
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
            self._take_tally()
            return self._lock.stamp(self._progress.as_json(self.identity))
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        return self._lock.stamp(start_state(self.identity, self.epoch))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state`` when iteration next starts: a consumer state (the same
        rank, worker and layout: exact), or a :func:`job_state` of every consumer (the
        same layout: exact; another: elastic). Raises :class:`ResumeError` for a state of
        another format version, dataset, shard list or seed."""
        self.identity.check(state)
        self._lock.check_state(state)
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

    def prepare(self, workers: int | None = None) -> ResumableDataset:
        """Load or learn the shards' sample offsets, and hand the shards out to the
        caches, now, in this process (DataLoader workers forked afterwards inherit both
        instead of each reading the index and computing the hand-out); ``workers`` (the
        DataLoader's ``num_workers``) is what ``len()`` counts.

        Learning with a torch.distributed process group initialised here is a collective
        (every rank must call it; the first ``set_epoch()`` does it too): each rank
        indexes its own cache's shards and the offsets are gathered, one read of each
        shard across the job. Without one they are exchanged through the launcher's store
        (:mod:`~shardcache._datasets.job_index`), here or in the DataLoader workers."""
        self._count_workers(workers)
        _, world_size, local_world_size = self._ranks()
        per_cache = self._ranks_per_cache(world_size, local_world_size)
        self._epoch_split().unit_shares(world_size // per_cache, per_cache)
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
                [self._samples[url].starts for url in self._read_urls],
                seed=self.seed,
                shuffle=self.shuffle_shards,
                remainder=self.remainder,
                epoch_size=self.epoch_size,
                lay=self._lay,
                scope=self.shuffle_scope,
            )
            empty = [url for url in self._read_urls if self._samples[url].count == 0]
            if empty:
                logger.warning(
                    "%d of %d shards hold no sample and are left out (first: %s)",
                    *(len(empty), len(self.urls), empty[0]),
                )
            given = (self._lock.lock, self.urls, self._read_urls)
            self._stage.peers = mesh_peers(self._cache(), self._split, *given, self._ranks())
        elif self._lay is not None and self._split.lay != self._lay:  # a mixture's new weights
            self._split = self._split.relaid(self._lay)
        return self._split

    def _sample_index(self) -> SampleIndex:
        """The sample offsets by the URLs read: a lockfile checked first, or made after."""
        if self._lock.location is None:
            return self._offsets(self.urls, {})
        cache = self._cache()
        threads = self._threads or cache.settings.threads
        read = self._lock.read_urls(self.urls, cache, threads=threads)
        held: dict[str, ShardIdentity] = {}  # the copies the job's other caches hold
        samples = self._offsets(read or self.urls, held)
        if read is None:  # no lockfile yet: made of the copies just read
            read = self._lock.record(self.urls, cache, threads=threads, held=held)
            if read != self.urls:  # another process's lock won and pins some shards
                samples = self._offsets(read, {})
        self._read_urls = read
        return samples

    def _offsets(self, urls: list[str], held: dict[str, ShardIdentity]) -> SampleIndex:
        """The sample offsets of ``urls`` (plain, or pinned); ``held``: see job_index()."""
        if self.index is not None:  # the index file names the shards' plain URLs
            return dict(zip(urls, load_index(self.index, self.urls).values(), strict=True))
        cache = self._cache()
        rank, world_size, local_world_size = self._ranks()
        per_cache = self._ranks_per_cache(world_size, local_world_size)
        return job_index(
            urls,
            self.identity.digest if urls == self.urls else urls_digest(urls),
            cache,
            mine=rank_part(len(urls), self.seed, self.shuffle_shards, rank, world_size, per_cache),
            layout=(rank, world_size, per_cache),
            threads=self._threads or cache.settings.threads,
            handler=self._stage.handler,
            keep=self.keep_index,
            identities=held,
        )

    def share_taken(self) -> tuple[int, int]:
        """The samples this consumer gets in the running epoch, and has delivered (0, 0)."""
        progress = self._progress
        return (0, 0) if progress is None else (progress.sizes.get("own", 0), progress.delivered)

    def cache_urls(self) -> list[str]:
        """The shards this process's cache (its rank's, or its node's at node scope) reads
        in every epoch (with ``shuffle_scope="global"``: in the epoch set): what to warm so
        that training makes no request."""
        rank, world_size, local_world_size = self._ranks()
        per = self._ranks_per_cache(world_size, local_world_size)
        owned = self._epoch_split().shard_units(world_size // per, per, self.epoch)[rank // per]
        return [self._read_urls[shard] for shard in owned]

    # -- iteration ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        in_worker = torch.utils.data.get_worker_info() is not None
        if in_worker and self._progress is not None:
            return refuse_persistent_workers()  # raised from next(): the worker survives it
        slot, consumers, per_unit = self._consumer()
        pending, self._pending = self._pending, None
        epoch = self.epoch if pending is None else int(pending["epoch"])
        progress = progress_for(
            self._epoch_split(),
            epoch,
            pending,
            Consumer(slot, consumers, per_unit),
            self._checker(),
            buffer_size=self.shuffle_buffer,
        )
        self._progress = progress
        hasher = SampleHasher(self.urls, progress.epoch, self._source)
        self._recorder = recorder = Recorder(hasher, self._epoch_split().starts)
        stream: Iterator[Any] = self._delivered(progress, recorder)
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
        return local_world_size if self._settings().scope == "node" else 1

    def _consumer(self) -> tuple[int, int, int]:
        """This consumer's slot, the number of consumers, and how many share its cache."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world_size, local_world_size = self._ranks()
        per_unit = self._ranks_per_cache(world_size, local_world_size) * workers
        return rank * workers + worker, world_size * workers, per_unit

    def _delivered(self, progress: Progress, recorder: Recorder) -> Iterator[dict[str, Any]]:
        """The consumer's samples in order; ``progress`` is kept true at every yield, and
        ``recorder`` records each sample that leaves."""
        key = (self.seed, progress.epoch, progress.carried or "", progress.consumers, progress.slot)
        draws = RandomDraws(*key, draws=progress.draws)
        shuffler = ShuffleBuffer(progress, draws, self._source)
        record = recorder.positions.append
        skip = skipper(progress, recorder, self._epoch_split())
        metrics.set_epoch(progress.epoch)
        if progress.item == 0 and progress.taken == 0 and not progress.buffer:
            log_sizes(progress)
        delivered, source = progress.delivered, self._source
        try:
            ranged: set[int] = set()
            if progress.buffer and self._samples is not None:  # a resumed shuffle buffer
                ranged = restore_ranged(
                    progress, shuffler, self._read_urls, self._samples, self._cache(), self._threads
                )
            for opened in self._stage.opened(visits(self._read_urls, progress, ranged)):
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
                item = detail
                skip(item, shuffler.drop_unrestored())
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
                        progress, opened, self._samples, self._epoch_split(), source
                    ):
                        if (out := shuffler.add(sample)) is not None:
                            progress.delivered += 1
                            record(shuffler.out)
                            yield out
                except ShardFormatError as exn:
                    if not self._stage.handler(exn):
                        return
                if progress.item == item:  # an empty piece, or one the handler gave up on
                    skip(item + 1, [])
                    advance(progress, item + 1)
                metrics.count(samples=progress.delivered - delivered, source=source)  # a piece
                recorder.fold(at_least=self._fold_at)
                delivered = progress.delivered
            skip(len(progress.plan), shuffler.drop_unrestored())
            advance(progress, len(progress.plan))
            while (out := shuffler.drain_one()) is not None:
                progress.delivered += 1
                record(shuffler.out)
                yield out
        finally:  # what was yielded since the last count (a mixture stops at its share)
            metrics.count(samples=progress.delivered - delivered, source=self._source)
        if self._source is None:  # a mixture's source: the mixture closes the epoch
            self._check_share_end()
            metrics.end_epoch(progress.epoch)

    # -- the delivery check (shardcache._datasets.delivery_check) -------------------------

    def check_delivery(
        self, *states: Any, epoch_end: bool = False, on_mismatch: str | None = None
    ) -> DeliveryCheck | None:
        """Check what the job delivered of its epoch against the plan: ``states`` are every
        rank's (what :func:`job_state` takes), at a checkpoint (the plan up to each
        consumer's position) or, with ``epoch_end``, after the epoch's last batch (the whole
        plan). A mismatch raises :class:`DeliveryMismatchError` or warns (``on_mismatch``:
        "raise", "warn"; None: ``SHARDCACHE_DELIVERY_CHECK``). Returns the check (seen,
        expected), None for states written before shardcache kept tallies."""
        job = job_state(*states)
        self.identity.check(job)
        return self._checker(on_mismatch).job_check(job, epoch_end=epoch_end)

    def _check_share_end(self) -> DeliveryCheck | None:
        """In the iterating process: this consumer's tally against its whole plan (run
        when its share of the epoch ends; a mixture runs it for its sources)."""
        if self._progress is None:
            return None
        self._take_tally()
        return self._checker().share_end(self._progress)

    def _take_tally(self) -> None:
        progress, recorder = self._progress, self._recorder
        if progress is not None and recorder is not None:
            folded = recorder.take()
            progress.seen = None if progress.seen is None else progress.seen + folded

    def _checker(self, on_mismatch: str | None = None) -> Checker:
        mode = mode_of(on_mismatch, self._settings().delivery_check)
        return Checker(self._epoch_split(), self.urls, self._source, mode)

    def _settings(self) -> Settings:
        """The settings of the cache the dataset reads through (given, or the environment's)."""
        cache = self._stage.cache
        return cache.settings if cache is not None else Settings.resolve()

    def _cache(self) -> ShardCache:
        return self._stage.cache if self._stage.cache is not None else ShardCache.from_env()
