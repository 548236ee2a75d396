"""Pins: a shard in use is held open with a shared ``flock`` so the evictor leaves it alone.

A reader pins the published file (an open file from :meth:`ShardCache.open`, the WebDataset
stage's stream, a prefetched shard not yet consumed); the evictor removes a file only while
holding an exclusive ``flock`` on it, taken without blocking, so it never removes a pinned
shard. The kernel drops the pins of a process that dies. :func:`is_held` is the one answer
to "does some process hold this file" (a pinned shard, a held lock file).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import BinaryIO

from .._base.safefs import SafeFS
from .._disk.layout import CacheLayout
from .._locking.flock import CONTENTION_ERRNOS


def pin(layout: CacheLayout, path: Path) -> int | None:
    """Open the published shard ``path`` with a shared lock; None if it is gone (evicted
    meanwhile). Resolved through the cache's directory descriptors (:class:`SafeFS`)."""
    try:
        fd = layout.fs.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link put at the shard's name: not ours, fetch again
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink == 0:  # removed while we waited for the lock
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_pinned(layout: CacheLayout, path: Path) -> BinaryIO:
    """Open a published shard for reading, pinned (not evictable) until closed."""
    fd = pin(layout, path)
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, "evicted before it could be opened", str(path))
    return os.fdopen(fd, "rb")


def reopen_pinned(pin_fd: int) -> BinaryIO:
    """Open again, for reading and pinned until closed, the shard that ``pin_fd`` pins."""
    return os.fdopen(pin_again(pin_fd), "rb")


def pin_again(fd: int) -> int:
    """A new read-only descriptor of the file open as ``fd``, pinned (shared flock): a new
    open file description of the same inode (its own offset and its own lock), which works
    even when the file's name is gone."""
    pinned = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(pinned, fcntl.LOCK_SH)
    except BaseException:
        os.close(pinned)
        raise
    return pinned


def is_held(fs: SafeFS, path: Path, dir_fd: int | None = None) -> bool | None:
    """Whether some process holds a ``flock`` on ``path`` right now: a reader's pin on a
    shard, a holder's lock on a lock file (None: cannot tell).

    Probes with a non-blocking exclusive ``flock`` on a fresh descriptor, released at once;
    never creates or deletes the file. A holder in this very process counts as holding it.
    ``dir_fd``: a descriptor of ``path``'s directory already opened through ``fs`` (one
    walk for a whole directory of files).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK
    try:
        if dir_fd is None:
            fd = fs.open(path, flags)
        else:
            fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return True if exc.errno in CONTENTION_ERRNOS else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
