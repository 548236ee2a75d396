"""Loader metrics: what each process counts, its periods and records, and where they go.

The record format is ``shardcache.metrics`` version 1 (docs/guides/observability.md): one JSON
object per period, counts per record (deltas), never cumulative, so a reader sums records.

Who counts what (each fact where it is born, thread-safe: prefetch threads count too):
cache hits/misses/shared/bytes, per-shard download time and the shards downloaded by how
each was verified (``verified``: method -> count, ``_cache``), requests sent
(``_transfer.download.s3_get``: GET; ``_transfer.remote.info``: HEAD; each attempt),
retries by cause and integrity re-downloads (the remote retry loops, through
:func:`retried`), lock waits with the holder (``_locking.shard_lock.ShardLock.acquire``),
the consumer's wait for data and stall warnings/errors (``_prefetch``,
``_store.growing``), shards and samples delivered (``_datasets.wds``; samples are counted
in batches, no lock per sample).

Mixtures. A ``MixtureDataset`` names its sources' shard URLs (:func:`name_sources`) and
labels its sources' sample counts, so records also carry ``sources``: per source name, its
``samples``, ``hits``, ``misses``, ``shared``, ``bytes_downloaded`` and ``bytes_served``
(a breakdown of the record's own counts; a URL listed by two sources counts for the one
named last).

Periods. Every process has one :class:`Collector` (made anew after a fork). An
``interval`` record is emitted when data flows and ``SHARDCACHE_METRICS_INTERVAL`` passed
since the last record; an ``epoch`` record closes each epoch with what is left of it (its
``start`` is the epoch's start); a ``close`` record (on ``CacheStage.close()`` and at
process exit) carries what is left after the last record, if anything.

The epoch boundary: the WebDataset stage (or ``ResumableDataset``) iterated to
exhaustion in this process, or an explicit :func:`log_epoch_summary` / :func:`end_epoch`.
The epoch number is the one ``ResumableDataset.set_epoch`` chose, else the number of
epochs this process closed before (inherited by forked DataLoader workers, so
non-persistent forked workers follow the main process's count as long as it closes its
epochs with :func:`log_epoch_summary`).

DataLoader workers are separate processes: each emits its own records (``worker`` = its
id) to the sinks and to its own file. For the rank's single log line, a worker also hands
its epoch total to the rank's main process through a private spool directory (one small
JSON file per worker and epoch, ``<tmp>/shardcache-<euid>/metrics-spool/<main pid>/``,
``_observe.spool``);
the main process merges them with its own counts when it closes the epoch
(:func:`log_epoch_summary`, or the stage's exhaustion when it iterates itself) and logs
one line. Workers log no line. A worker's spool file is written before its iterator
ends, hence before the DataLoader's epoch loop in the main process ends.

Files: ``SHARDCACHE_METRICS`` is off by default. A directory gets one file per process,
``<job>-r<rank>-w<worker|main>-<host>-<pid>.jsonl`` (``nojob`` outside SLURM/torchrun),
so no two processes ever append to one file; a value with ``{...}`` fields is a file name
pattern and must contain ``{pid}``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .._base.errors import ShardCacheError
from .._base.process_local import ProcessLocal
from .._base.redact import get_logger, redact_url
from .._config.settings import env_setting
from .metric_records import COUNTS, RETRY_CAUSES, SCHEMA, SOURCE_COUNTS, VERSION
from .spool import spool, unspool
from .summary import format_line, merge

logger = get_logger(__name__)

SLOWEST = 5  # slowest shards kept per record

Sink = Callable[[dict[str, Any]], object]


def add_metrics_sink(sink: Sink) -> Callable[[], None]:
    """Call ``sink(record)`` with every metrics record this process makes (a dict, the
    ``shardcache.metrics`` schema, the same as a line of a ``SHARDCACHE_METRICS`` file);
    returns a function that removes it. A sink runs in the thread that closed the period
    and must be quick; its exceptions are logged and ignored. Sinks belong to the process
    that added them (forked DataLoader workers inherit them, spawned ones do not)."""
    if not callable(sink):
        raise TypeError(f"a metrics sink must be callable, not {type(sink).__name__}")
    state = _process.get()
    with state.sinks_lock:
        state.sinks.append(sink)

    def remove() -> None:
        with state.sinks_lock, contextlib.suppress(ValueError):
            state.sinks.remove(sink)

    return remove


class _Period:
    """The counts of one period (only touched under the collector's lock)."""

    def __init__(self, wall: float, mono: float) -> None:
        self.wall, self.mono = wall, mono
        self.counts = dict.fromkeys(COUNTS, 0)
        self.requests: dict[str, int] = {}
        self.verified: dict[str, int] = {}  # shards downloaded, per verification method
        self.retries = dict.fromkeys(RETRY_CAUSES, 0)
        self.lock_count, self.lock_seconds, self.lock_worst = 0, 0.0, 0.0
        self.lock_holder: str | None = None
        self.data_wait = 0.0
        self.slowest: list[dict[str, Any]] = []
        self.sources: dict[str, dict[str, float]] = {}  # per mixture source: SOURCE_COUNTS

    def empty(self) -> bool:
        return not (
            any(self.counts.values())
            or self.sources
            or self.requests
            or self.verified
            or any(self.retries.values())
            or self.lock_count
            or self.data_wait
        )


class Collector:
    """This process's counters and periods. Use :func:`collector`, not the class."""

    def __init__(self, state: _ProcessMetrics, epoch: int = 0) -> None:
        self._state = state
        self._lock = threading.Lock()
        self.pid = os.getpid()
        self.epoch = epoch  # the epoch in progress
        now_wall, now_mono = time.time(), time.monotonic()
        self._period = _Period(now_wall, now_mono)
        self._epoch_start = now_wall
        self._epoch_records: list[dict[str, Any]] = []
        self._identity: dict[str, Any] | None = None
        self._interval: float | None = None
        self._target: str | None = None  # SHARDCACHE_METRICS, None: no file
        self._write_failed = False
        self.last_rank_report: dict[str, Any] | None = None

    # -- counting (any thread) -------------------------------------------------------

    def add(self, source: str | None = None, **deltas: float) -> None:
        """Add ``deltas`` to the period's counts (and to ``source``'s, when given)."""
        with self._lock:
            counts = self._period.counts
            for name, delta in deltas.items():
                counts[name] += delta  # type: ignore[assignment]
            if source is not None:
                mine = self._period.sources.setdefault(source, dict.fromkeys(SOURCE_COUNTS, 0))
                for name, delta in deltas.items():
                    if name in mine:
                        mine[name] += delta

    def request(self, method: str) -> None:
        with self._lock:
            requests = self._period.requests
            requests[method] = requests.get(method, 0) + 1

    def verified(self, method: str) -> None:
        """A shard downloaded by this process was published, verified by ``method``."""
        with self._lock:
            verified = self._period.verified
            verified[method] = verified.get(method, 0) + 1

    def retry(self, cause: str) -> None:
        with self._lock:
            self._period.retries[cause] += 1

    def waited_for_data(self, seconds: float) -> None:
        with self._lock:
            self._period.data_wait += seconds

    def lock_wait(self, seconds: float, holder: str | None) -> None:
        with self._lock:
            p = self._period
            p.lock_count += 1
            p.lock_seconds += seconds
            if seconds >= p.lock_worst:
                p.lock_worst, p.lock_holder = seconds, holder

    def shard_downloaded(self, url: str, seconds: float, nbytes: int | None) -> None:
        entry = {"url": redact_url(url), "seconds": round(seconds, 3), "bytes": nbytes}
        with self._lock:
            slowest = self._period.slowest
            slowest.append(entry)
            slowest.sort(key=lambda e: -e["seconds"])
            del slowest[SLOWEST:]

    # -- periods -----------------------------------------------------------------------

    def tick(self) -> None:
        """Emit an interval record if the interval passed (called where data flows)."""
        if time.monotonic() - self._period.mono >= self.interval():
            record = self._take("interval")
            self._epoch_records.append(record)
            self._emit(record)

    def end_epoch(self, epoch: int | None = None) -> dict[str, Any]:
        """Close the epoch in progress (``epoch``, when given, names it): emit its
        ``epoch`` record; returns the epoch's total for this process (in the main
        process: with the totals its DataLoader workers spooled, and logged as one line)."""
        with self._lock:
            if epoch is not None:
                self.epoch = epoch
        record = self._take("epoch", start=self._epoch_start)
        records = [*self._epoch_records, record]
        # The share of the whole epoch (the record's start is the epoch's start).
        record["data_wait_share"] = _share(sum(r["data_wait_s"] for r in records), record)
        self._emit(record)
        total = merge(records)
        with self._lock:
            self._epoch_records = []
            self._epoch_start = record["time"]
            self.epoch = record["epoch"] + 1
        if self.identity()["worker"] is not None:
            spool(total)
            return total
        total = merge([total, *unspool(self._state.spooled_after)])
        self.last_rank_report = total
        logger.info(format_line(total))
        return total

    def close(self) -> dict[str, Any] | None:
        """Emit a ``close`` record for what is left, if anything; in the training process
        also log its line (with what DataLoader workers handed over since the last one)."""
        main = self.identity()["worker"] is None
        spooled = unspool(self._state.spooled_after) if main else []
        with self._lock:
            empty = self._period.empty()
        record = None if empty else self._take("close")
        if record is not None:
            self._emit(record)
        if main and (record is not None or spooled):
            logger.info(format_line(merge([r for r in [record, *spooled] if r is not None])))
        return record

    def _take(self, kind: str, start: float | None = None) -> dict[str, Any]:
        """The record of the period ending now; a new period begins."""
        wall, mono = time.time(), time.monotonic()
        with self._lock:
            p, self._period = self._period, _Period(wall, mono)
            epoch = self.epoch
        record: dict[str, Any] = {
            "schema": SCHEMA,
            "version": VERSION,
            "kind": kind,
            "time": wall,
            "start": p.wall if start is None else start,
            **self.identity(),
            "epoch": epoch,
            **p.counts,
            "requests": p.requests,
            "verified": p.verified,
            "retries": p.retries,
            "lock_waits": {
                "count": p.lock_count,
                "seconds": round(p.lock_seconds, 6),
                "worst_s": round(p.lock_worst, 6),
                "worst_holder": p.lock_holder,
            },
            "data_wait_s": round(p.data_wait, 6),
            "slowest_shards": p.slowest,
        }
        if p.sources:
            record["sources"] = p.sources
        record["period_s"] = round(max(0.0, wall - record["start"]), 6)
        record["data_wait_share"] = _share(p.data_wait, record)
        return record

    # -- where records go --------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        if self._identity is None:
            self._identity = _identity()
        return self._identity

    def interval(self) -> float:
        if self._interval is None:
            self._configure()
        assert self._interval is not None
        return self._interval

    def _configure(self) -> None:
        explicit = self._state.explicit
        if explicit:  # a cache's own settings (configure()) win over the environment
            self._target, self._interval = explicit["target"], explicit["interval"]
            return
        try:
            self._target = env_setting("metrics")
            self._interval = env_setting("metrics_interval")
        except ShardCacheError as exc:  # a bad value: said once, metrics never stop a job
            logger.warning("shardcache metrics are off: %s", exc)
            self._target, self._interval = None, 30.0

    def _emit(self, record: dict[str, Any]) -> None:
        if self._interval is None:
            self._configure()
        if self._target is not None:
            self._write(record)
        with self._state.sinks_lock:
            sinks = list(self._state.sinks)
        for sink in sinks:
            try:
                sink(record)
            except Exception:
                logger.warning("metrics sink %r failed; record dropped for it", sink, exc_info=True)

    def _write(self, record: dict[str, Any]) -> None:
        assert self._target is not None
        path = file_for(self._target, record)
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)  # one write per line: a reader never sees half a line
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._write_failed:
                self._write_failed = True
                logger.warning("cannot write metrics to %s: %s (records dropped)", path, exc)


def file_for(target: str, record: dict[str, Any]) -> Path:
    """The file of this process's records: ``target`` is a directory, or a pattern."""
    fields = {
        "job": record["job_id"] or "nojob",
        "rank": record["rank"],
        "worker": "main" if record["worker"] is None else record["worker"],
        "host": record["host"],
        "pid": record["pid"],
    }
    if "{" in target:
        return Path(target.format(**fields))
    return Path(target) / "{job}-r{rank}-w{worker}-{host}-{pid}.jsonl".format(**fields)


def _share(wait: float, record: dict[str, Any]) -> float:
    period = record["period_s"]
    return round(min(1.0, wait / period), 6) if period > 0 else 0.0


def _identity() -> dict[str, Any]:
    from ..distributed import rank_info

    try:
        info = rank_info()
        ranks = {
            "job_id": info.job_id,
            "rank": info.rank,
            "local_rank": info.local_rank,
            "node_rank": info.node_rank,
            "world_size": info.world_size,
        }
    except ShardCacheError:  # malformed launcher variables must not stop the data
        ranks = {"job_id": None, "rank": 0, "local_rank": 0, "node_rank": 0, "world_size": 1}
    return {"host": socket.gethostname(), "pid": os.getpid(), **ranks, "worker": _worker_id()}


def _worker_id() -> int | None:
    data = sys.modules.get("torch.utils.data")  # imported by the program if it uses torch
    if data is None:
        return None
    with contextlib.suppress(Exception):
        info = data.get_worker_info()
        return None if info is None else int(info.id)
    return None


# -- the process's state -----------------------------------------------------------------


class _ProcessMetrics:
    """What the metrics keep per process: its collector; the sinks, the mixture sources'
    shard URLs (:func:`name_sources`) and the target set in code (:func:`configure`), all
    three inherited by a forked child (a DataLoader worker's collector is new, with what the
    training process configured); ``spooled_after``: worker totals spooled before it are
    not this state's (a fresh state's, within the process)."""

    def __init__(
        self, inherited: _ProcessMetrics | None = None, spooled_after: float | None = None
    ) -> None:
        self.sinks: list[Sink] = [] if inherited is None else list(inherited.sinks)
        self.sinks_lock = threading.Lock()
        self.source_of: dict[str, str] = {} if inherited is None else dict(inherited.source_of)
        self.explicit: dict[str, Any] = {} if inherited is None else dict(inherited.explicit)
        self.spooled_after = spooled_after
        self.made: Collector | None = None  # made on first count: its first period starts then
        self._lock = threading.Lock()
        if inherited is not None and inherited.made is not None:
            self.made = Collector(self, inherited.made.epoch)  # the count of epochs goes on

    def collector(self) -> Collector:
        made = self.made
        if made is not None:
            return made
        with self._lock:
            if self.made is None:
                self.made = Collector(self)
            return self.made

    def forked(self) -> _ProcessMetrics:
        """The child's state: a new collector (if the parent had one) that continues the
        epoch count."""
        return _ProcessMetrics(inherited=self)


_process: ProcessLocal[_ProcessMetrics] = ProcessLocal(
    _ProcessMetrics,
    after_fork=_ProcessMetrics.forked,
    restart=lambda: _ProcessMetrics(spooled_after=time.time()),
)


def configure(target: str | None, interval: float) -> None:
    """Write this process's records to ``target`` (``SHARDCACHE_METRICS``'s forms), every
    ``interval`` seconds: ``ShardCache(metrics=..., metrics_interval=...)`` calls it, so a
    value given in code counts like the environment's (the last cache made wins)."""
    state = _process.get()
    state.explicit.update(target=target, interval=interval)
    if state.made is not None:
        state.made._target, state.made._interval = target, interval


def collector() -> Collector:
    """This process's collector (made on first use, and anew in a forked child)."""
    return _process.get().collector()


def _at_exit() -> None:
    state = _process.peek()
    made = None if state is None else state.made
    if made is not None and made.pid == os.getpid():
        with contextlib.suppress(Exception):
            made.close()


atexit.register(_at_exit)


# -- shortcuts for the hooks -------------------------------------------------------------


def name_sources(source: str, urls: Iterable[str]) -> None:
    """Count what the cache does for ``urls`` also as mixture source ``source``'s."""
    _process.get().source_of.update(dict.fromkeys(urls, source))


def count(url: str | None = None, source: str | None = None, **deltas: float) -> None:
    """Add ``deltas`` to this process's counts; ``source`` (or the source ``url`` was
    named for) gets them too."""
    state = _process.get()
    if source is None and url is not None:
        source = state.source_of.get(url)
    state.collector().add(source, **deltas)


def shard_delivered() -> None:
    """The consumer got one more shard: counted, and an interval record if one is due."""
    made = collector()
    made.add(shards=1)
    made.tick()


def request(method: str) -> None:
    collector().request(method)


def verified(method: str) -> None:
    """A shard this process downloaded was published, verified by ``method``."""
    collector().verified(method)


def retried(cause: str) -> None:
    """A remote attempt failed and will be tried again: count its cause (``retry_cause``)."""
    if cause == "integrity":
        collector().add(integrity_redownloads=1)
    else:
        collector().retry(cause)


def end_epoch(epoch: int | None = None) -> dict[str, Any]:
    """Close this process's epoch now (see :meth:`Collector.end_epoch`)."""
    return collector().end_epoch(epoch)


def set_epoch(epoch: int) -> None:
    """The epoch in progress (``ResumableDataset`` knows it)."""
    made = collector()
    made.epoch = epoch


def records_of(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Records from JSON lines (blank lines skipped)."""
    return [json.loads(line) for line in lines if line.strip()]
