"""How a lock waiter spends the time between attempts: :class:`Pause`, a sleep cut short
the moment the holder lets go where the lock mode can tell, and :func:`paced`, a check
taken at a doubling interval (a node-lock waiter's look for the published shard)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from .._base.redact import get_logger
from .backend import LockBackend, ReleaseSignal

logger = get_logger(__name__)


class Pause:
    """A waiter's sleep between attempts, cut short the moment the holder lets go where the
    lock mode can tell (flock: :class:`~shardcache._locking.flock.ReleaseWatch`); a plain
    sleep where it cannot (lease) or watching failed."""

    def __init__(self, backend: LockBackend, path: Path) -> None:
        self._backend = backend
        self._path = path
        self._signal: ReleaseSignal | None = None
        self._polling = False

    def __call__(self, seconds: float) -> None:
        if not self._polling and (self._signal is None or self._signal.released.is_set()):
            self._watch()
        if self._signal is None:
            time.sleep(seconds)
        else:
            self._signal.released.wait(seconds)

    def _watch(self) -> None:
        """A new watch for the current holder (the last one saw its predecessor go)."""
        error = self._signal.error if self._signal is not None else None
        self._signal = None
        if error is None:
            try:
                self._signal = self._backend.watch_release()
            except OSError as exc:
                error = exc
        if self._signal is None:
            self._polling = True
            if error is not None:
                logger.debug("cannot watch %s for its release (%s): polling", self._path, error)


def paced(check: Callable[[], bool] | None, first: float, most: float) -> Callable[[], bool] | None:
    """``check`` called at most once per interval, the interval doubling from ``first`` to
    ``most`` (in between, the last answer, which is False: a True ends the wait)."""
    if check is None:
        return None
    interval, due = first, time.monotonic()

    def paced() -> bool:
        nonlocal interval, due
        now = time.monotonic()
        if now < due:
            return False
        due, interval = now + interval, min(most, interval * 2)
        return check()

    return paced
