"""The worker side of the prefetcher: what it calls (:class:`Fetch`, with the
:class:`WorkerProgress` it hands over and the :class:`Early` shard a fetch may offer), one
shard's state in the window (:class:`Task`), the state the consumer and the workers share
(:class:`Shared`), the progress callback and the worker loop.

Invariants:

- A worker takes the oldest queued shard first (FIFO) and publishes its outcome, path or
  error, under ``Shared.cond``; every ``Task`` field after ``url`` is guarded by it.
- The first shard leads: the other workers start once its request was answered (its phase
  moved past ``requesting``), it ended, or ``LEAD_TIME`` passed. Its request does not
  queue behind the others' on the client's event loop, nor share the server and the link
  with them while the consumer waits for its first bytes; the others start one round
  trip later, once.
- Workers reference only :class:`Shared`, never the ``Prefetcher``, so dropping the last
  reference to the prefetcher runs its ``__del__``, which cancels them.
- Once cancelled, a fetch's next progress call raises a private ``BaseException`` (retry
  loops that catch ``Exception`` neither retry nor wrap it); a shard fetched after the
  cancellation that nobody will consume is released at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from .._transfer.download import REQUESTING
from .._transfer.remote import Progress
from .diagnostics import RateMeter

QUEUED, RUNNING, DONE = "queued", "running", "done"
LEAD_TIME = 1.0  # seconds the other workers wait at most for the first shard's answer
_UNANSWERED = frozenset({"queued", "started", REQUESTING})  # phases before an answer


class Fetch(Protocol):
    """What the prefetcher calls in a worker: ``ShardCache.fetch`` or a test double.

    It must call ``progress`` as bytes arrive; once the prefetcher is closed that call
    raises (see the module docstring), and ``progress.cancelled`` is set, for fetchers
    that block without reporting. While its request waits for an answer it reports the
    phase ``REQUESTING`` (or nothing); any other phase tells the workers held back by the
    first shard (see the module docstring) to start.
    """

    def __call__(self, url: str, progress: WorkerProgress) -> Path: ...


class WorkerProgress(Progress, Protocol):
    """The ``progress`` a worker hands to its :class:`Fetch`: called as bytes arrive (it
    raises once the prefetcher is closed), ``cancelled`` set then too, and ``offer`` for a
    download the consumer may read before it ends (:meth:`Prefetcher.next_early`)."""

    cancelled: threading.Event

    def offer(self, early: Early) -> None: ...


Release = Callable[[Path], None]
"""Called once for every fetched path the consumer is done with (see ``release``)."""


class Early(Protocol):
    """What a fetch may offer (``progress.offer(early)``) when its shard can be read before
    the fetch ends: the consumer takes it with ``claim()`` (False: too late, the fetch is
    ending: wait for its outcome instead)."""

    path: Path

    def claim(self) -> bool: ...


class _Cancelled(BaseException):
    """Raised inside a fetch by its progress callback once the prefetcher is closed.

    A ``BaseException`` so retry loops that catch ``Exception`` neither retry nor wrap it.
    """


class Task:
    """One shard in the window. Fields after ``url`` are guarded by ``Shared.cond``."""

    __slots__ = (
        "bytes_done",
        "bytes_total",
        "early",
        "error",
        "from_source",
        "handed_over",
        "index",
        "last_change",
        "meter",
        "path",
        "phase",
        "started",
        "state",
        "submitted",
        "thread_ident",
        "thread_name",
        "url",
    )

    def __init__(self, index: int, url: str, now: float) -> None:
        self.index = index
        self.url = url
        self.state = QUEUED
        self.path: Path | None = None
        self.handed_over = False  # given to the consumer, or released: never release again
        self.error: BaseException | None = None
        self.from_source = False  # the error came from iterating ``urls``, not a fetch
        self.phase = "queued"
        self.bytes_done = 0
        self.bytes_total: int | None = None
        self.submitted = now
        self.started: float | None = None
        self.last_change = now  # the watchdog's clock: bytes or phase last changed
        self.thread_name: str | None = None
        self.thread_ident: int | None = None
        self.meter = RateMeter()
        self.early: Early | None = None  # what the fetch offered for reading before it ends


class Shared:
    """State shared by the consumer and the workers.

    Workers reference only this, never the ``Prefetcher``: dropping the last reference to
    the prefetcher therefore runs its ``__del__``, which cancels them.
    """

    def __init__(self, fetch: Fetch, clock: Callable[[], float], release: Release | None) -> None:
        self.fetch = fetch
        self.clock = clock
        self.release = release
        self.cond = threading.Condition()
        self.cancelled = threading.Event()  # set once, under cond; read without it
        self.queue: deque[Task] = deque()  # FIFO, so the oldest shard always starts first
        self.workers: dict[str, Task | None] = {}  # thread name -> its shard (None: idle)
        self.meter = RateMeter()  # all workers' bytes
        self.threads: list[threading.Thread] = []
        self.lead: Task | None = None  # the first shard taken (see the module docstring)
        self.lead_until = 0.0  # when the others start even if the lead has no answer yet

    def lead_wait(self) -> float:
        """Seconds another worker still waits for the leading shard (0: start). Under
        ``cond``."""
        lead = self.lead
        if lead is None or lead.state == DONE or lead.phase not in _UNANSWERED:
            return 0.0
        return max(0.0, self.lead_until - self.clock())


class _Reporter:
    """The ``progress`` callable handed to ``fetch`` for one shard."""

    __slots__ = ("_shared", "_task", "cancelled")

    def __init__(self, shared: Shared, task: Task) -> None:
        self._shared = shared
        self._task = task
        self.cancelled = shared.cancelled

    def __call__(self, *, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        if self.cancelled.is_set():
            raise _Cancelled(self._task.url)
        shared, task = self._shared, self._task
        with shared.cond:
            now = shared.clock()
            if bytes_done != task.bytes_done or phase != task.phase:
                task.last_change = now
            if bytes_done > task.bytes_done:  # a restart from byte 0 is not negative progress
                delta = bytes_done - task.bytes_done
                task.meter.add(delta, now)
                shared.meter.add(delta, now)
            answered = task is shared.lead and task.phase in _UNANSWERED
            task.phase, task.bytes_done, task.bytes_total = phase, bytes_done, bytes_total
            if answered and phase not in _UNANSWERED:
                shared.cond.notify_all()  # the workers waiting for the lead start

    def offer(self, early: Early) -> None:
        """The fetch can be read before it ends (:meth:`Prefetcher.next_early`)."""
        shared, task = self._shared, self._task
        with shared.cond:
            if task.early is None and task.state != DONE:
                task.early = early
                shared.cond.notify_all()


def work(shared: Shared, name: str) -> None:
    """Worker loop: take the oldest queued shard, fetch it, publish the outcome."""
    cond = shared.cond
    while True:
        with cond:
            while not shared.cancelled.is_set():
                wait = shared.lead_wait() if shared.queue else None
                if wait is not None and wait <= 0:
                    break
                cond.wait(wait)
            if shared.cancelled.is_set():
                return
            task = shared.queue.popleft()
            now = shared.clock()
            if shared.lead is None:
                shared.lead, shared.lead_until = task, now + LEAD_TIME
            task.state, task.phase = RUNNING, "started"
            task.started = task.last_change = now
            task.thread_name, task.thread_ident = name, threading.get_ident()
            shared.workers[name] = task
        path: Path | None = None
        error: BaseException | None = None
        try:
            path = Path(shared.fetch(task.url, progress=_Reporter(shared, task)))
        except _Cancelled:
            with cond:  # the task stays unfinished: nobody will consume it
                shared.workers[name] = None
            return
        except BaseException as exc:  # handed to the consumer, which re-raises it
            error = exc
        with cond:
            shared.workers[name] = None
            released = shared.cancelled.is_set() and not task.handed_over
            if released and path is not None and shared.release is not None:
                task.handed_over = True  # nobody will consume it: release it now
                shared.release(path)
            task.state, task.path, task.error = DONE, path, error
            cond.notify_all()
        del error  # the task owns it now; no frame -> traceback -> frame cycle here


__all__ = ["DONE", "Early", "Fetch", "Release", "Shared", "Task", "work"]
