"""One request-rate throttle per process, shared by every thread that talks to S3.

Why (``bench/studies/at_scale.py`` and docs/internals/at-scale-model.md have the numbers): S3 serves
at least 5,500 GET/HEAD requests per second per partitioned prefix and answers ``503
SlowDown`` above what a prefix currently takes. A job of 1000 nodes x 8 ranks x 4 DataLoader
workers starts about a million requests at once (4 prefetch threads x 8 ranged GETs per
process). With a backoff of its own per request, every one of those requests has to be
refused before its thread slows down, the retries of a million requests keep coming far
above the limit, and requests run out of retries (``TransientFetchError``) while the prefix
still refuses most of them.

So a ``SlowDown`` (or any throttling answer: :func:`shardcache._retry.policy.is_throttled`) slows
the whole process, in the manner of TCP's congestion control (multiplicative decrease,
then growth while requests succeed):

* every request of the process first takes a slot from :meth:`Throttle.acquire`; until the
  first throttling answer there is no limit and no wait;
* a throttling answer to a request sent after the last cut halves the process's rate (the
  first time: half of what it sent over the last second) and pushes the next slot a
  jittered interval away, so that thousands of processes that were refused together do
  not come back together. Answers to requests sent before that cut were caused by the same
  excess: they do not cut again;
* every answered request grows the rate by :data:`GROWTH` (5 %): a process grows as fast
  as it hears back, so 32,000 processes at a fraction of a request per second each probe
  the limit slowly together, while a lone process that was slowed down by a passing
  overload is back at full speed after a few hundred requests (past :data:`RELEASE` it is
  unlimited again);
* ``SHARDCACHE_MAX_REQUEST_RATE`` caps the rate from the start (requests per second per
  process), and ``SHARDCACHE_JOB_REQUEST_RATE`` does so for the whole job (each process
  takes an even share: the rate / (world size x DataLoader workers)): the only ways to stay
  under a known limit without any ``SlowDown`` at all.

The throttle makes refusals rare; :class:`~shardcache._retry.policy.RetryPolicy` decides what a
refusal costs: nothing for ``SHARDCACHE_SLOWDOWN_RETRY_TIME`` from a request's first
refusal, then an attempt, so a request is retried through a job start's storm of refusals
but not forever.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from .._base.process_local import ProcessLocal
from .._base.redact import get_logger
from .._observe import metrics
from .policy import is_throttled

logger = get_logger(__name__)

T = TypeVar("T")

BETA = 0.5  # a cut keeps this fraction of the rate
GROWTH = 0.05  # each answered request grows a throttled rate by this fraction
MIN_RATE = 0.05  # requests/s a process is never slowed below (one request per 20 s)
WINDOW = 1.0  # seconds over which the send rate before the first cut is measured
FLOOR = 8.0  # requests/s a first cut starts from at least (a quiet process is not starved)
RELEASE = 1e5  # requests/s: a rate grown past this is no limit any more


class Throttle:
    """A process's request slots: unlimited (or ``max_rate``) until throttled, then AIMD.

    ``clock`` and ``sleep`` are injectable for tests; both default to the real ones.
    """

    def __init__(
        self,
        max_rate: float | None = None,
        *,
        job_rate: float | None = None,
        world_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self._configured = max_rate
        self._job_rate = job_rate
        self._world_size = max(1, world_size)
        self.max_rate = max_rate  # the cap in force (with job_rate: once the process sends)
        self._clock = clock
        self._sleep = sleep
        self._start_afresh()
        _live.add(self)

    def _start_afresh(self) -> None:
        """No limit but ``max_rate``, nothing sent: a new throttle, or a forked child's copy
        of its parent's (whose lock another thread may have held at the fork)."""
        self._lock = threading.Lock()
        # A job-wide rate is shared out by the process that sends (a DataLoader worker knows
        # its worker count only once it runs): resolved at the first request.
        self._cap_resolved = self._job_rate is None
        self._rate: float | None = None  # the adaptive limit; None until the first cut
        self._grown_at = 0.0  # when _rate was last brought up to date
        self._cut_at = float("-inf")  # when the rate was last cut
        self._next = float("-inf")  # the earliest time the next request may be sent
        self._sent: deque[float] = deque()  # send times within WINDOW (before the first cut)
        self.cuts = 0  # how many times the rate was cut (for diagnostics and tests)

    @property
    def rate(self) -> float | None:
        """The limit in force now (requests/s), None when there is none."""
        with self._lock:
            return self._limit(self._clock())

    def acquire(self) -> float:
        """Wait for this request's slot; returns the time it is sent (pass it back)."""
        while True:
            due, at = self.poll()
            if due:
                return at
            self._sleep(at)

    def poll(self) -> tuple[bool, float]:
        """``(True, now)``: the slot is taken, send now; ``(False, seconds)``: ask again
        after that long. Nothing is reserved ahead: waiting threads compete for the next
        slot at the rate in force when it comes, so a rate that grows serves them sooner
        and no wait is longer than one slot (20 s at :data:`MIN_RATE`)."""
        with self._lock:
            now = self._clock()
            limit = self._limit(now)
            if limit is not None and self._next < now - 1.0 / limit:
                # Idle for a slot or more: start at a random phase of a slot, so that
                # processes that start (or come back) together do not send in lock step.
                self._next = now + random.uniform(0.0, 1.0 / limit)
            if now < self._next:
                return False, self._next - now
            if limit is not None:
                self._next = now + 1.0 / limit
            if self._rate is None:
                self._sent.append(now)
                while self._sent and self._sent[0] <= now - WINDOW:
                    self._sent.popleft()
            return True, now

    def throttled(self, sent_at: float) -> None:
        """The request sent at ``sent_at`` was refused with a throttling answer."""
        with self._lock:
            now = self._clock()
            if sent_at <= self._cut_at:
                return  # sent before the last cut: the same excess, already answered
            before = self._limit(now)
            if before is None:
                before = max(len(self._sent) / WINDOW, FLOOR)
                self._sent.clear()
            rate = max(MIN_RATE, BETA * before)
            if self.max_rate is not None:
                rate = min(rate, self.max_rate)
            self._rate, self._grown_at, self._cut_at = rate, now, now
            # The next slot lies a jittered interval away: processes refused together
            # come back spread over that interval, not in lock step.
            self._next = max(self._next, now + random.uniform(0.5, 1.0) / rate)
            self.cuts += 1
        logger.info(
            "the store asked to slow down (SlowDown): this process now sends at most %.3g "
            "requests/s (cut %d)",
            rate,
            self.cuts,
        )

    def succeeded(self) -> None:
        """A request was answered (not throttled): a throttled rate grows by
        :data:`GROWTH`. Growth per answer, not per second: a process at a low rate hears
        back rarely, and must not grow faster than it learns whether the store keeps up."""
        with self._lock:
            if self._rate is not None:
                self._rate *= 1.0 + GROWTH
                if self._rate > RELEASE:
                    self._rate = None

    def _limit(self, now: float) -> float | None:
        """The rate in force (call with the lock held): the adaptive one, capped by
        ``max_rate``."""
        if not self._cap_resolved:
            assert self._job_rate is not None
            share = self._job_rate / (self._world_size * dataloader_workers())
            self.max_rate = share if self._configured is None else min(self._configured, share)
            self._cap_resolved = True
        if self._rate is None:
            return self.max_rate
        return self._rate if self.max_rate is None else min(self._rate, self.max_rate)


class _ProcessThrottles:
    """The throttles of one process, one per set of caps (a forked child starts with none:
    its requests are its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_caps: dict[tuple[float | None, float | None, int], Throttle] = {}


_process: ProcessLocal[_ProcessThrottles] = ProcessLocal(_ProcessThrottles)
# Every throttle of this process: a fork's child starts each of them afresh, since a cache
# built before the fork (a DataLoader worker's copy of the main process's) keeps its object.
_live: weakref.WeakSet[Throttle] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for throttle in list(_live):
        throttle._start_afresh()


os.register_at_fork(after_in_child=_after_fork_in_child)


def process_throttle(
    max_rate: float | None, job_rate: float | None = None, world_size: int = 1
) -> Throttle:
    """The throttle of this process for these caps (one per value, started afresh in a
    forked child: a child's requests are its own). ``job_rate`` is shared evenly by the
    job's processes: ``world_size`` ranks times the DataLoader workers of each."""
    throttles, key = _process.get(), (max_rate, job_rate, world_size)
    with throttles.lock:
        throttle = throttles.by_caps.get(key)
        if throttle is None:
            throttle = Throttle(max_rate, job_rate=job_rate, world_size=world_size)
            throttles.by_caps[key] = throttle
        return throttle


def dataloader_workers() -> int:
    """The DataLoader worker count of this rank when called in a worker process, else 1
    (torch is not imported for this)."""
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    return int(info.num_workers) if info is not None else 1


def throttled_call(throttle: Throttle, method: str, request: Callable[[], T]) -> T:
    """Send ``request()`` (an HTTP ``method`` request, counted in the metrics) in its
    slot; a throttling answer slows the process down and is raised on (the caller's retry
    policy decides about the request itself)."""
    sent = throttle.acquire()
    metrics.request(method)
    try:
        result = request()
    except Exception as exc:
        if is_throttled(exc):
            throttle.throttled(sent)
        raise
    throttle.succeeded()
    return result
