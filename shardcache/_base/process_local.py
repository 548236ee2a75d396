"""State that belongs to one process: the loader metrics, the request-rate throttles.

A :class:`ProcessLocal` holds one value per process, made on first use. In a forked child
(a DataLoader worker) the parent's value is carried over by the holder's ``after_fork``
(for example: keep the sinks, start a new collector) before any thread of the child can
look at it, and the holder's lock is new (the parent's may have been held by a thread
that does not exist in the child).

Every holder is known here, so :func:`fresh_state` can give a block of code new values
for all of them and put the old ones back afterwards: the way a test suite keeps one
test's counts and throttling out of the next (``shardcache.testing.fresh_process_state``),
with no reset function in the modules that own the state.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_HOLDERS: list[ProcessLocal] = []  # every holder made (module-level singletons: few)


class ProcessLocal(Generic[T]):
    """One ``T`` per process: ``factory()`` on first use; in a forked child,
    ``after_fork(parent's value)`` (default: made anew on first use); in a
    :func:`fresh_state` block, ``restart()`` (default: made anew on first use)."""

    def __init__(
        self,
        factory: Callable[[], T],
        *,
        after_fork: Callable[[T], T | None] | None = None,
        restart: Callable[[], T] | None = None,
    ) -> None:
        self._factory = factory
        self._after_fork = after_fork
        self._restart = restart
        self._value: T | None = None
        self._lock = threading.Lock()
        _HOLDERS.append(self)

    def get(self) -> T:
        """This process's value."""
        value = self._value
        if value is not None:
            return value
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    def peek(self) -> T | None:
        """This process's value if it was made, else None (nothing is made)."""
        return self._value

    def _forked(self) -> None:
        self._lock = threading.Lock()
        if self._value is not None:
            self._value = None if self._after_fork is None else self._after_fork(self._value)


def _after_fork_in_child() -> None:
    for holder in _HOLDERS:
        holder._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def fresh_state() -> Iterator[None]:
    """Within the block, every :class:`ProcessLocal` starts again (its ``restart``, else its
    factory on first use); after it, the values from before are back. Not for use while
    other threads use the state."""
    saved = [(holder, holder._value) for holder in _HOLDERS]
    for holder in _HOLDERS:
        holder._value = None if holder._restart is None else holder._restart()
    try:
        yield
    finally:
        for holder, value in saved:
            holder._value = value
