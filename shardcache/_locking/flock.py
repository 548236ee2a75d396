"""The ``flock`` lock backend (local disks).

``fcntl.flock`` on ``<hash>.lock``, taken directly rather than through ``filelock``, whose
behaviour changed across versions (lock-file removal on release, a silent fallback to a
soft lock): these invariants are ours to keep. The kernel frees the lock of a dead holder at
once, so nothing is ever broken here; the holder's progress goes to ``<hash>.owner`` for
waiters to judge. Lock files are never deleted: unlinking a locked file lets the next
contender lock a new inode while the old holder still holds the old one (two holders).

A waiter is woken the moment the holder lets go (:class:`ReleaseWatch`: a thread blocked in
``flock`` on its own descriptor, which lets go as soon as it gets the lock) rather than at
its next poll: when several processes of a node read the same shards, each waiting for the
one that downloads, a poll's delay was paid once per shard by every waiter.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path

from .._base.safefs import SafeFS
from .._disk.layout import owner_path
from .records import rewrite

# What a non-blocking flock raises when another descriptor holds the lock.
CONTENTION_ERRNOS = frozenset({errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK})


def open_shared(fs: SafeFS, path: Path, access: int = os.O_RDWR) -> int:
    """Open (creating if missing) a file every holder of the lock uses: never through a
    link, never truncated, never blocking (a FIFO planted there); one we created gets the
    cache's lock-file mode and group."""
    # No O_TRUNC: the file is shared with holders; never a link's target (SafeFS).
    fd = fs.open(path, access | os.O_CREAT | os.O_NONBLOCK, 0o600)
    trust = fs.trust
    try:
        st = os.fstat(fd)
        if st.st_uid == trust.uid and stat.S_IMODE(st.st_mode) != trust.lock_mode:
            trust.adopt_file(fd, trust.lock_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_flock(fs: SafeFS, path: Path) -> int | None:
    """Take an exclusive ``flock`` on ``path`` without blocking: the descriptor (close it to
    release), or None if another holder has it. The file is created if missing (with the
    cache's lock-file mode) and never followed through a link, never truncated, never
    deleted. Raises ``OSError``; ENOENT means the file was removed or replaced meanwhile:
    try again."""
    # Read-only is enough for flock: a lock file another member of a shared cache made
    # without group write permission still locks.
    fd = open_shared(fs, path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in CONTENTION_ERRNOS:
                os.close(fd)
                return None
            raise
        # Removed or replaced between our open and our flock (a tmp cleaner): the next
        # contender would lock another inode, so retry on the file that is there now.
        if os.fstat(fd).st_ino != fs.lstat(path).st_ino:
            raise FileNotFoundError(errno.ENOENT, "lock file replaced while locking", str(path))
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd


class ReleaseWatch:
    """Set :attr:`released` the moment the ``flock`` on a lock file is free: a daemon thread
    blocks in ``flock`` on its own descriptor and closes it (letting go) once it has the lock.

    It only wakes a waiter, which then tries the lock as usual: another contender may win
    it first. A watch whose waiter gave up (a stuck holder) ends when that holder does.
    """

    def __init__(self, fd: int) -> None:
        self.released = threading.Event()
        self.error: OSError | None = None  # flock failed: the waiter must poll instead
        threading.Thread(
            target=self._run, args=(fd,), name="shardcache-lock-release", daemon=True
        ).start()

    def _run(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            self.error = exc
        finally:
            os.close(fd)  # lets the lock go at once if we got it
            self.released.set()


class FlockBackend:
    """A shard lock held as an exclusive ``flock`` on the lock file (see the module)."""

    expires = False  # the kernel frees a dead holder's flock: nothing to renew or break

    def __init__(self, fs: SafeFS, path: Path) -> None:
        self.fs = fs
        self.path = path
        self.record_path = owner_path(path)
        self._lock_fd: int | None = None
        self._record_fd: int | None = None

    def try_acquire(self) -> bool:
        self._lock_fd = try_flock(self.fs, self.path)
        return self._lock_fd is not None

    def watch_release(self) -> ReleaseWatch:
        return ReleaseWatch(open_shared(self.fs, self.path, os.O_RDONLY))

    def open_record(self) -> None:
        # The owner record is shared by all holders in turn: opened, never truncated on open.
        self._record_fd = open_shared(self.fs, self.record_path)

    def write_record(self, data: bytes) -> bool:
        assert self._record_fd is not None
        rewrite(self._record_fd, data)
        return True

    def break_stale(self, judged: bytes) -> bool:
        return False  # a flock is never broken: a stuck holder is reported, not overruled

    def release(self) -> None:
        record_fd, self._record_fd = self._record_fd, None
        lock_fd, self._lock_fd = self._lock_fd, None
        try:
            if record_fd is not None:
                os.close(record_fd)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # closing the last descriptor releases the flock
