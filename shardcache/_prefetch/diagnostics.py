"""What the prefetcher tells people: download rates, starvation warnings, stall reports.

The prefetch window (:mod:`shardcache._prefetch.prefetcher`) decides *when*: it measures bytes into
a :class:`RateMeter`, records each consumed shard in a :class:`StarvationMonitor` and, once the
awaited shard has made no progress for ``stall_timeout``, calls :func:`stall_error`. This module
decides *what is said*: nothing here blocks, starts threads or changes the window, so a report can
never alter what the prefetcher does.

- Rates are bytes/s over the last ``RATE_WINDOW`` seconds, from coarse samples (bounded
  memory however many reads are reported).
- Starvation is the share of the consumer's time spent waiting, over recent shards; above
  ``STARVATION_SHARE`` one warning (at most one per ``STARVATION_WARN_INTERVAL``) names the
  rates and the knobs, before anything becomes an error.
- A ``StallError`` carries everything in its message (DataLoader re-raises a worker's
  exception from its message alone): the shard, where it ran, its worker thread, phase,
  bytes, rates, the queue, every worker's state, the stuck thread's stack and hints.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import textwrap
import traceback
from collections import deque
from collections.abc import Mapping
from typing import Protocol

from .._base.errors import ConfigError, ShardCacheError, StallError
from .._base.units import format_bytes, format_rate
from ..distributed import rank_info

RATE_WINDOW = 10.0  # "recent rate" = bytes/s over this many seconds
STACK_LIMIT = 40  # innermost frames of the stalled worker's stack in a StallError

STARVATION_SHARE = 0.3  # warn when the consumer waits more than this share of its time
STARVATION_WINDOW_SECONDS = 30.0  # judged over the shards consumed in the last 30 s ...
STARVATION_MIN_SHARDS = 5  # ... but never fewer than the last 5 shards
STARVATION_MIN_SPAN = 10.0  # no verdict before the window covers 10 s (start-up bursts)
STARVATION_WARN_INTERVAL = 60.0  # at most one warning per minute per prefetcher

_SAMPLE_EVERY = 0.25  # rate meters keep one (time, bytes) sample per this many seconds
_MAX_CYCLES = 4096  # memory bound of the starvation window (many tiny shards)
_WAITING_FOR_HOLDER = "waiting for "  # ShardCache's phase while another process downloads


class RateMeter:
    """Cumulative bytes with coarse samples: bytes/s over the last ``RATE_WINDOW``."""

    def __init__(self) -> None:
        self.total = 0
        # (time, total before that time's bytes), oldest first, >= _SAMPLE_EVERY apart;
        # at most one sample older than the window is kept, as the baseline.
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, nbytes: int, now: float) -> None:
        samples = self._samples
        if not samples or now - samples[-1][0] >= _SAMPLE_EVERY:
            samples.append((now, self.total))
        self.total += nbytes
        while len(samples) > 1 and samples[1][0] <= now - RATE_WINDOW:
            samples.popleft()

    def rate(self, now: float) -> float:
        if not self._samples:
            return 0.0
        base_time, base_total = self._samples[0]
        for sample_time, sample_total in self._samples:
            if sample_time > now - RATE_WINDOW:
                break
            base_time, base_total = sample_time, sample_total
        elapsed = now - base_time
        return (self.total - base_total) / elapsed if elapsed > 0 else 0.0


def _check_evidence(min_shards: int, min_span: float) -> None:
    """Raise :class:`ConfigError` unless a starvation verdict needs at least one shard and
    a span of zero seconds or more."""
    if isinstance(min_shards, bool) or not isinstance(min_shards, int) or min_shards < 1:
        raise ConfigError(
            f"starvation_min_shards={min_shards!r}: expected a whole number of shards, 1 or more.",
            name="starvation_min_shards",
            value=min_shards,
        )
    if isinstance(min_span, bool) or not isinstance(min_span, int | float) or min_span < 0:
        raise ConfigError(
            f"starvation_min_span={min_span!r}: expected a number of seconds, 0 or more.",
            name="starvation_min_span",
            value=min_span,
        )


class StarvationMonitor:
    """Share of the consumer's time spent waiting for shards, over a recent window; judged
    only once the window holds at least ``min_shards`` shards over ``min_span`` seconds."""

    def __init__(
        self,
        threads: int,
        depth: int,
        *,
        min_shards: int = STARVATION_MIN_SHARDS,
        min_span: float = STARVATION_MIN_SPAN,
    ) -> None:
        _check_evidence(min_shards, min_span)
        self._threads = threads
        self._depth = depth
        self._min_shards = min_shards
        self._min_span = min_span
        # (start, end, waited, downloaded bytes at end) per consumed shard, oldest first;
        # cycles are contiguous: each starts where the previous one ended.
        self._cycles: deque[tuple[float, float, float, int]] = deque()
        self._waited = 0.0  # sum of the window's waits
        self._last_warning: float | None = None

    @property
    def evidence(self) -> tuple[int, float]:
        """(``min_shards``, ``min_span``): what a verdict needs."""
        return self._min_shards, self._min_span

    def record(self, start: float, end: float, waited: float, downloaded: int) -> str | None:
        """Add one shard's cycle; returns a warning to log, or None."""
        cycles = self._cycles
        cycles.append((start, end, waited, downloaded))
        self._waited += waited
        while len(cycles) > _MAX_CYCLES or (
            len(cycles) > self._min_shards and cycles[0][1] < end - STARVATION_WINDOW_SECONDS
        ):
            self._waited -= cycles.popleft()[2]
        span = end - cycles[0][0]
        if len(cycles) < self._min_shards or span < self._min_span:
            return None
        share = self._waited / span
        if share <= STARVATION_SHARE:
            return None
        if self._last_warning is not None and end - self._last_warning < STARVATION_WARN_INTERVAL:
            return None
        self._last_warning = end
        base_end, base_bytes = cycles[0][1], cycles[0][3]
        mbps = (downloaded - base_bytes) / (end - base_end) / 1e6 if end > base_end else 0.0
        return (
            f"shardcache: the consumer waited for data {share:.0%} of the time over the last "
            f"{len(cycles)} shards ({span:.0f}s): shards were consumed at "
            f"{len(cycles) / span:.2f}/s while downloads ran at {mbps:.1f} MB/s "
            f"({self._threads} threads, prefetch depth {self._depth}). Data loading is the "
            f"bottleneck: raise SHARDCACHE_THREADS (now {self._threads}) and "
            f"SHARDCACHE_PREFETCH_DEPTH (now {self._depth}); keep the data in the compute's "
            "region and check the network bandwidth. (Logged at most once every "
            f"{STARVATION_WARN_INTERVAL:.0f}s.)"
        )


class ShardProgress(Protocol):
    """What a report reads of one shard in the prefetch window (``_prefetch_workers.Task``)."""

    url: str
    phase: str
    bytes_done: int
    bytes_total: int | None
    submitted: float
    started: float | None
    last_change: float  # bytes or phase last changed
    thread_name: str | None
    thread_ident: int | None
    meter: RateMeter


def stall_error(
    task: ShardProgress,
    now: float,
    *,
    workers: Mapping[str, ShardProgress | None],
    all_workers: RateMeter,
    in_flight: int,
    unconsumed: int,
    started_threads: int,
    threads: int,
    depth: int,
    stall_timeout: float,
) -> StallError:
    """The :class:`StallError` for ``task``, which made no progress while awaited.

    ``workers`` maps each worker thread's name to its shard (None: idle), ``all_workers``
    meters every worker's bytes; the caller holds the lock guarding them."""
    thread = task.thread_name or "(no worker picked it up)"
    started = task.started if task.started is not None else task.submitted
    elapsed = now - started
    idle = now - task.last_change
    total = task.bytes_total
    if total:
        expected = f"{total} expected ({format_bytes(total)}; {task.bytes_done / total:.1%})"
    else:
        expected = "an unknown total (size not known yet)"
    worker_lines = []
    for name, current in sorted(workers.items()):
        if current is None:
            worker_lines.append(f"    {name}: idle, no shard")
        else:
            worker_lines.append(
                f"    {name}: {current.url} phase={current.phase!r} "
                f"bytes {current.bytes_done}/{_fmt_total(current.bytes_total)}, "
                f"idle for {now - current.last_change:.1f}s"
            )
    frame = sys._current_frames().get(task.thread_ident) if task.thread_ident else None
    if frame is None:
        stack = "    (the thread is not running)\n"
    else:
        stack = textwrap.indent("".join(traceback.format_stack(frame, STACK_LIMIT)), "  ")
    where = where_this_runs()
    holder_hint = ""
    if task.phase.startswith(_WAITING_FOR_HOLDER):  # ShardCache's lock-wait phase
        holder_hint = (
            f"  - this process was {task.phase}, which holds the shard's lock and whose "
            "download made no progress either (its progress counts as ours while it "
            "moves): look at that process; `shardcache status` lists every lock holder "
            "with its phase and bytes\n"
        )
    message = (
        f"prefetch stalled: {task.url} made no progress for {idle:.1f}s (stall_timeout "
        f"{stall_timeout:g}s) while the consumer was waiting for it.\n"
        f"  where: {where}\n"
        f"  worker thread: {thread}\n"
        f"  elapsed since the shard started: {elapsed:.1f}s (phase {task.phase!r})\n"
        f"  bytes: {task.bytes_done} done of {expected}\n"
        f"  recent rate: {format_rate(task.meter.rate(now))} for this shard, "
        f"{format_rate(all_workers.rate(now))} for all workers (last {RATE_WINDOW:.0f}s); "
        f"{format_rate(task.bytes_done / elapsed if elapsed > 0 else 0.0)} since it started\n"
        f"  queue: {in_flight} in flight, {unconsumed} done unconsumed, depth {depth}, "
        f"threads {started_threads}\n"
        "  workers:\n" + "\n".join(worker_lines) + "\n"
        f"  stack of {thread}:\n{stack}"
        "  hints:\n"
        + holder_hint
        + "  - a read that hangs means the store is unreachable, overloaded or far away: "
        "check the network and whether the data lives in another region than the "
        "compute; SHARDCACHE_IO_TIMEOUT bounds each request so a hung read fails and "
        "is retried\n"
        f"  - more parallel downloads: SHARDCACHE_THREADS (now {threads}); more "
        f"read-ahead: SHARDCACHE_PREFETCH_DEPTH (now {depth})\n"
        "  - if shards are legitimately this slow to show progress (a very slow link, a "
        "store that answers in large blocks), raise SHARDCACHE_STALL_TIMEOUT (now "
        f"{stall_timeout:g}s)"
    )
    return StallError(
        message,
        url=task.url,
        elapsed=elapsed,
        stalled_for=idle,
        stall_timeout=stall_timeout,
        bytes_done=task.bytes_done,
        bytes_total=total,
        thread=thread,
        phase=task.phase,
        where=where,
    )


def where_this_runs() -> str:
    """This process in the job: pid, host, rank and DataLoader worker, for a StallError.

    DataLoader re-raises a worker's exception in the training process from its message
    alone, so these facts go into the message, not only into attributes.
    """
    try:
        rank = rank_info().describe()
    except ShardCacheError as exc:  # malformed launcher variables must not hide the stall
        rank = f"rank unknown ({exc})"
    data = sys.modules.get("torch.utils.data")  # imported by the program if it uses torch
    worker = None
    if data is not None:
        with contextlib.suppress(Exception):  # a partially imported or broken torch
            worker = data.get_worker_info()
    in_loader = (
        "not in a DataLoader worker"
        if worker is None
        else f"DataLoader worker {worker.id} of {worker.num_workers}"
    )
    return f"pid {os.getpid()} on {socket.gethostname()}, {rank}, {in_loader}"


def _fmt_total(total: int | None) -> str:
    return "?" if total is None else str(total)


__all__ = [
    "RATE_WINDOW",
    "STARVATION_SHARE",
    "RateMeter",
    "ShardProgress",
    "StarvationMonitor",
    "stall_error",
    "where_this_runs",
]
