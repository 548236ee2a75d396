"""``Prefetcher``: download shards ahead of the consumer with a small thread pool.

::

    with cache.prefetch(urls) as shards:        # threads/depth/stall_timeout from settings
        for url, path in shards:                # PrefetchedShard(url, path), in input order
            train_on(path)

Invariants:

- Order: shards come out in input order whatever order they finish in. A failure surfaces
  at its shard's position, after every earlier shard was yielded.
- Bound: ``depth`` counts every shard the prefetcher holds: queued, downloading, and
  downloaded but not yet returned by ``next()`` (the shard ``next()`` is about to return
  included). While the consumer works on one shard, up to ``depth - 1`` later shards
  download; ``depth=1`` fetches on demand (still in a worker, still watched).
- Laziness: ``urls`` is pulled in the consumer's thread, only when the window has room, so
  an infinite iterator (webdataset's ``ResampledShards``) is fine. Threads start on the
  first ``next()``, in the process that iterates: a fresh prefetcher pickles (DataLoader
  spawn/fork), a started one refuses to.
- Cold start: the first shard leads; the other workers start once its request was
  answered, it ended, or ``LEAD_TIME`` passed (:mod:`shardcache._prefetch.workers`).
- Cancellation: ``close()``, leaving a ``for`` loop over it (``break``, exception, end), the
  ``with`` block, or garbage collection cancel queued shards and make every in-flight
  download raise a private ``BaseException`` from its next progress callback. That unwinds
  ``ShardCache.fetch`` like any error: its ``.part`` file is unlinked and its lock released.
  A read blocked in the kernel cannot be interrupted: that worker (a daemon) stops at its
  next progress callback, which comes at the latest when ``SHARDCACHE_IO_TIMEOUT`` ends the
  read. ``close()`` joins workers for at most ``timeout`` seconds and logs any still running.
- Watchdog: progress is bytes (and phase changes). When the consumer waits for a shard
  whose progress has not changed for ``stall_timeout``, ``next()`` raises ``StallError``
  with the shard, where it ran (pid, host, rank, DataLoader worker), its worker thread and
  phase, bytes, rates, queue, every worker's state, the stuck thread's stack and hints, all
  in the message (DataLoader re-raises a worker's exception from its message alone); the
  prefetcher is then closed. Progress is whatever the fetch reports: a slow link reports
  every read (an S3 body read returns as bytes arrive), and a shard another process is
  downloading reports that process's lock record (``ShardCache`` forwards it), so neither
  is a stall as long as bytes keep moving.
- Starvation: the share of time the consumer spends waiting is tracked over a recent
  window; above ``STARVATION_SHARE`` one warning (rate-limited) names the rates and the
  knobs, before anything becomes an error.

- Early reading (:meth:`Prefetcher.next_early`, used by the WebDataset stage and
  ``ShardCache.open``): a fetch may offer its shard for reading before it ends
  (``progress.offer``); the consumer claims it and reads while the worker finishes the
  download. Such a shard leaves the window when handed over, so the one being read may
  still download next to ``depth`` others; its reader waits with this prefetcher's
  watchdog (the same ``StallError``), and a failure after the hand-over reaches the reader.

This module is the window (order, bound, laziness, cancellation, when a wait is a stall);
the fetch interface, the shards' shared state and the worker loop live in
:mod:`shardcache._prefetch.workers`; the rate meter, the starvation monitor and the text of
the warning and of the ``StallError`` in :mod:`shardcache._prefetch.diagnostics`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, NoReturn

from .._base.errors import FetchError, ShardCacheError, StallError
from .._base.redact import get_logger
from .._config.settings import prefetch_overrides
from .._observe import metrics
from .diagnostics import (
    STARVATION_MIN_SHARDS,
    STARVATION_MIN_SPAN,
    STARVATION_SHARE,
    StarvationMonitor,
    stall_error,
)
from .workers import DONE, Early, Fetch, Release, Shared, Task, work

logger = get_logger(__name__)

THREAD_NAME_PREFIX = "shardcache-prefetch"
"""Every worker thread's name starts with this (``shardcache-prefetch-<n>-<i>``)."""
CLOSE_TIMEOUT = 10.0  # close(): seconds to wait for workers before leaving them (daemons)
STALL_CLOSE_TIMEOUT = 1.0  # after a StallError the stuck worker is not waited for long
_MAX_WAIT = 3600.0  # cap of one Condition.wait (stays below threading.TIMEOUT_MAX)
_sequence = itertools.count(1)


class PrefetchedShard(NamedTuple):
    """One downloaded shard: unpacks as ``url, path``."""

    url: str
    path: Path


def check_prefetch_options(
    *, threads: int | None = None, depth: int | None = None, stall_timeout: float | None = None
) -> None:
    """Raise :class:`ConfigError` for a prefetch option that cannot be used (None: not given),
    by the rules of the setting it overrides (SHARDCACHE_THREADS, _PREFETCH_DEPTH, ...)."""
    prefetch_overrides(threads=threads, depth=depth, stall_timeout=stall_timeout)


class Prefetcher:
    """Iterate over ``urls`` as :class:`PrefetchedShard` ``(url, path)``, in input order,
    fetching up to ``depth`` shards ahead with ``threads`` worker threads.

    >>> with Prefetcher(cache.fetch, urls, threads=4, depth=8, stall_timeout=300) as it:
    ...     for url, path in it: ...

    ``fetch(url, progress=...)`` runs in a worker and must report bytes through
    ``progress`` (:class:`Fetch`). Errors re-raise in the consumer at the shard's position:
    a :class:`ShardCacheError` that names a ``url`` as is (its worker traceback intact),
    anything else as :class:`FetchError` naming the URL, chained ``from`` the original.
    ``clock`` (monotonic seconds) is injectable for tests. The starvation warning is judged
    only over at least ``starvation_min_shards`` shards consumed in at least
    ``starvation_min_span`` seconds (5 and 10 s: start-up bursts are no verdict; lower
    them for a short run of slow shards). See the module docstring for the bound,
    cancellation, watchdog and starvation guarantees.

    Iterating with ``for`` closes the prefetcher when the loop ends, breaks or raises
    (``__iter__`` is a generator over ``next()``); so do ``with``, ``close()`` and garbage
    collection. Only ``min(threads, depth)`` threads are started: more could never be busy.
    """

    def __init__(
        self,
        fetch: Fetch,
        urls: Iterable[str],
        *,
        threads: int,
        depth: int,
        stall_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        release: Release | None = None,
        starvation_min_shards: int = STARVATION_MIN_SHARDS,
        starvation_min_span: float = STARVATION_MIN_SPAN,
    ) -> None:
        check_prefetch_options(threads=threads, depth=depth, stall_timeout=stall_timeout)
        self._fetch = fetch
        self._urls = urls
        self.threads = threads
        self.depth = depth
        self.stall_timeout = float(stall_timeout)
        self._clock = clock
        # The shard last returned by next(), released (e.g. unpinned) at the following
        # next() or at close(): the consumer is done with it by then.
        self._release = release
        self._held: Path | None = None
        self.name = f"{THREAD_NAME_PREFIX}-{next(_sequence)}"
        # Runtime state: created by the first next(), in the process that iterates.
        self._shared: Shared | None = None
        self._pid: int | None = None
        self._source: Iterator[str] | None = None
        self._window: deque[Task] = deque()  # input order; len <= depth
        self._next_index = 0
        self._exhausted = False  # no more urls will be pulled
        self._finished = False  # next() raises StopIteration from now on
        self._left_behind: set[threading.Thread] = set()  # stuck workers a shutdown gave up on
        self._last_return: float | None = None
        self._stall: StallError | None = None  # raised again by every later next_early()
        self._starvation = StarvationMonitor(
            threads, depth, min_shards=starvation_min_shards, min_span=starvation_min_span
        )

    # -- pickling (DataLoader workers) ------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        if self._shared is not None or self._finished:
            raise TypeError(
                f"cannot pickle {self!r}: it has already started iterating (it owns threads "
                "and locks) or was closed. Pickle (or hand to DataLoader) a Prefetcher before "
                "iterating it; its threads start lazily in the process that iterates."
            )
        return {
            "fetch": self._fetch,
            "urls": self._urls,
            "threads": self.threads,
            "depth": self.depth,
            "stall_timeout": self.stall_timeout,
            "clock": self._clock,
            "release": self._release,
            "starvation_evidence": self._starvation.evidence,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["fetch"],
            state["urls"],
            threads=state["threads"],
            depth=state["depth"],
            stall_timeout=state["stall_timeout"],
            clock=state["clock"],
            release=state["release"],
            starvation_min_shards=state["starvation_evidence"][0],
            starvation_min_span=state["starvation_evidence"][1],
        )

    def __repr__(self) -> str:
        state = "finished" if self._finished else "running" if self._shared else "not started"
        return (
            f"Prefetcher({self.name}, threads={self.threads}, depth={self.depth}, "
            f"stall_timeout={self.stall_timeout:g}, {state})"
        )

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[PrefetchedShard]:
        """Shards in input order; closes the prefetcher when the loop ends, breaks or raises.

        One consumer thread at a time: the prefetcher is not meant to be shared by consumers.
        """
        try:
            while True:
                try:
                    shard = self.__next__()
                except StopIteration:
                    return
                yield shard
        finally:
            self.close()

    def __next__(self) -> PrefetchedShard:
        return self._advance(early=False)[0]

    def next_early(self) -> tuple[PrefetchedShard, Early | None, Callable[[], float]]:
        """Like ``next()``, but returns a shard as soon as its fetch offered it for reading
        (:class:`Early`, claimed for the caller) instead of when the fetch ended; the third
        item, called while reading it, returns how long a reader may wait for more bytes and
        raises this prefetcher's ``StallError`` once the shard stalled. An early shard is
        not released by the prefetcher (its reader pins it); a later fetch failure reaches
        the reader, not the prefetcher. Raises the ``StallError`` again once one was
        raised."""
        return self._advance(early=True)

    def iter_early(self) -> Iterator[tuple[PrefetchedShard, Early | None, Callable[[], float]]]:
        """:meth:`next_early` until the end, closing the prefetcher like ``__iter__``."""
        try:
            while True:
                try:
                    item = self.next_early()
                except StopIteration:
                    return
                yield item
        finally:
            self.close()

    def _advance(self, *, early: bool) -> tuple[PrefetchedShard, Early | None, Callable[[], float]]:
        if early and self._stall is not None:
            raise self._stall
        self._release_held()
        if self._finished:
            self._window.clear()  # only the consumer's thread touches the window
            raise StopIteration
        shared = self._start()
        entered = self._clock()
        self._fill(shared)
        if not self._window:
            self.close()
            raise StopIteration
        head = self._window[0]
        try:
            claimed = self._wait_for(shared, head, early)
        except StallError as stall:
            self._stall_shutdown(stall)
            raise
        self._window.popleft()
        if head.error is not None and not claimed:
            error, head.error = head.error, None
            self.close()
            self._window.clear()  # later shards' outcomes (and errors) are dropped
            self._raise_failure(head, error)
        assert claimed or head.path is not None  # a done task without error has a path
        now = self._clock()
        metrics.collector().waited_for_data(now - entered)
        if self._last_return is not None:  # the first wait is the cold start: not judged
            warning = self._starvation.record(
                self._last_return, now, now - entered, shared.meter.total
            )
            if warning is not None:
                metrics.count(stall_warnings=1)
                logger.warning(warning)
        self._last_return = now
        with shared.cond:
            head.handed_over = True
        if claimed:
            assert head.early is not None
            shard = PrefetchedShard(head.url, head.early.path)
            return shard, head.early, functools.partial(self._until_stall, shared, head)
        self._held = head.path if self._release is not None else None
        return PrefetchedShard(head.url, head.path), None, self._no_stall

    def _start(self) -> Shared:
        if self._shared is not None:
            if self._pid != os.getpid():
                raise RuntimeError(
                    f"{self!r} was started in process {self._pid} and copied into process "
                    f"{os.getpid()} by fork; its threads do not exist here. Create or pickle "
                    "the Prefetcher before iterating it (e.g. in the dataset's __iter__)."
                )
            return self._shared
        self._source = iter(self._urls)
        shared = Shared(self._fetch, self._clock, self._release)
        for i in range(min(self.threads, self.depth)):
            name = f"{self.name}-{i}"
            shared.workers[name] = None
            shared.threads.append(
                threading.Thread(target=work, args=(shared, name), name=name, daemon=True)
            )
        self._shared, self._pid = shared, os.getpid()
        for thread in shared.threads:
            thread.start()
        logger.debug("%r started", self)
        return shared

    def _fill(self, shared: Shared) -> None:
        """Top the window up to ``depth``, pulling ``urls`` only while there is room."""
        assert self._source is not None
        while len(self._window) < self.depth and not self._exhausted:
            try:
                url = next(self._source)
            except StopIteration:
                self._exhausted = True
                break
            except Exception as exc:  # surfaces in order, after the shards before it
                task = Task(self._next_index, "<urls>", self._clock())
                task.state, task.error, task.from_source = DONE, exc, True
                self._window.append(task)
                self._exhausted = True
                break
            task = Task(self._next_index, url, self._clock())
            self._next_index += 1
            self._window.append(task)
            with shared.cond:
                shared.queue.append(task)
                shared.cond.notify_all()

    def _wait_for(self, shared: Shared, task: Task, early: bool = False) -> bool:
        """Block until ``task`` is done, or (``early``) offered and claimed (then True);
        raise StallError once it stops progressing."""
        with shared.cond:
            while True:
                if shared.cancelled.is_set():  # closed (maybe by another thread) meanwhile
                    self._finished = True
                    self._window.clear()
                    raise StopIteration
                if task.state == DONE:
                    return False
                if early and task.early is not None and task.early.claim():
                    return True
                now = shared.clock()
                idle = now - task.last_change
                if idle >= self.stall_timeout:
                    raise self._stall_error(shared, task, now)
                shared.cond.wait(min(self.stall_timeout - idle, _MAX_WAIT))

    def _until_stall(self, shared: Shared, task: Task) -> float:
        """For the reader of an early shard: seconds it may wait for more bytes; raises the
        StallError (and closes the prefetcher) once the shard's progress stopped for
        ``stall_timeout``. Runs in the consumer's thread."""
        if self._stall is not None:
            raise self._stall
        with shared.cond:
            now = shared.clock()
            idle = now - task.last_change
            if task.state == DONE or idle < self.stall_timeout:
                return min(max(self.stall_timeout - idle, 0.001), _MAX_WAIT)
            stall = self._stall_error(shared, task, now)
        self._stall_shutdown(stall)
        raise stall

    @staticmethod
    def _no_stall() -> float:
        return _MAX_WAIT

    def _stall_shutdown(self, stall: StallError) -> None:
        metrics.count(stall_errors=1)
        self._stall = stall
        self._shutdown(STALL_CLOSE_TIMEOUT, stuck_expected=True)
        self._window.clear()

    def _raise_failure(self, task: Task, error: BaseException) -> NoReturn:
        if task.from_source or (isinstance(error, ShardCacheError) and getattr(error, "url", None)):
            raise error  # keeps its own traceback (the worker's frames) and message
        cause = f"{type(error).__name__}: {error}"
        raise FetchError(
            f"prefetching {task.url} failed in {task.thread_name}: {cause}. The original "
            "exception and its traceback are chained below.",
            url=task.url,
            attempts=1,
            cause=cause,
        ) from error

    def _stall_error(self, shared: Shared, task: Task, now: float) -> StallError:
        """The report of a stalled shard; called with ``shared.cond`` held."""
        in_flight = sum(1 for t in self._window if t.state != DONE)
        return stall_error(
            task,
            now,
            workers=shared.workers,
            all_workers=shared.meter,
            in_flight=in_flight,
            unconsumed=len(self._window) - in_flight,
            started_threads=len(shared.threads),
            threads=self.threads,
            depth=self.depth,
            stall_timeout=self.stall_timeout,
        )

    # -- shutdown --------------------------------------------------------------------

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Cancel queued and in-flight shards and join the workers, waiting at most
        ``timeout`` seconds (a worker blocked in a read is left: it is a daemon and stops
        at its next progress report). Idempotent."""
        self._shutdown(timeout, stuck_expected=False)

    def _shutdown(self, timeout: float, *, stuck_expected: bool) -> None:
        # May run in any thread: leaves the window to the consumer (next() clears it).
        self._finished = True
        shared = self._shared
        if shared is None or self._pid != os.getpid():
            return  # never started, or a fork's copy (its locks may be held by ghosts)
        with shared.cond:
            shared.cancelled.set()
            shared.queue.clear()
            shared.cond.notify_all()
            if self._release is not None:
                for task in list(self._window):
                    if task.state == DONE and task.path is not None and not task.handed_over:
                        task.handed_over = True
                        self._release(task.path)
        self._release_held()
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        # A worker an earlier shutdown already waited for (after a StallError) is not
        # waited for again: a second close() would block the caller for nothing.
        waited = [t for t in shared.threads if t is not me and t not in self._left_behind]
        for thread in waited:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._left_behind.update(t for t in waited if t.is_alive())
        alive = [t.name for t in waited if t.is_alive()]
        if alive:
            (logger.info if stuck_expected else logger.warning)(
                "%s: %d worker(s) still running %.1fs after close, probably blocked in a read: "
                "%s. They are daemon threads and stop at their next progress report "
                "(SHARDCACHE_IO_TIMEOUT bounds a blocked read).",
                self.name,
                len(alive),
                timeout,
                ", ".join(alive),
            )

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None and self._release is not None:
            self._release(held)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_shared", None) is not None and not getattr(self, "_finished", True):
            # Interpreter shutdown may have torn modules down: never raise from __del__.
            with contextlib.suppress(Exception):
                self.close()


__all__ = [
    "CLOSE_TIMEOUT",
    "STARVATION_SHARE",
    "THREAD_NAME_PREFIX",
    "PrefetchedShard",
    "Prefetcher",
]
