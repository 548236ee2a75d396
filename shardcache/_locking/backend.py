"""The interface a lock mode implements (:class:`LockBackend`): take, record and give up a
shard's lock file. ``_locking.flock`` and ``_locking.lease`` implement it;
``_locking.shard_lock.ShardLock`` does the waiting, judging and timing out around it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Protocol


class ReleaseSignal(Protocol):
    """Wakes a waiter when the holder lets go (:class:`~shardcache._locking.flock.ReleaseWatch`)."""

    released: threading.Event
    error: OSError | None


class LockBackend(Protocol):
    """How one lock mode takes, records and gives up a shard's lock file; :class:`ShardLock`
    does the waiting, judging and timing out around it. Methods raise ``OSError``."""

    record_path: Path  # where the holder's record is, for waiters to read
    expires: bool  # True: a silent holder's lock is broken, so the holder must renew it

    def try_acquire(self) -> bool:
        """One attempt, never blocking: True if the lock is now ours."""
        ...

    def watch_release(self) -> ReleaseSignal | None:
        """Something whose ``released`` event is set once the current holder lets go (and
        ``error`` says if watching failed), or None if this mode can only poll."""
        ...

    def open_record(self) -> None:
        """After acquiring: make the holder's record writable."""
        ...

    def write_record(self, data: bytes) -> bool:
        """Replace the holder's record; False if the lock turned out to be lost."""
        ...

    def break_stale(self, judged: bytes) -> bool:
        """Remove a stale holder's lock if its record is still ``judged``; True if removed."""
        ...

    def release(self) -> None:
        """Give the lock up (idempotent); only a lock still ours is removed."""
        ...


__all__ = ["LockBackend", "ReleaseSignal"]
