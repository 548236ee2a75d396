"""The ``lease`` lock backend (network file systems, where flock may silently exclude only
within a node).

The lock *is* the file ``<hash>.lease``, created atomically with ``os.link`` from a private
claim file holding the owner record. The holder rewrites the record as it makes progress,
and a renewal thread (:class:`Renewer`) rewrites it every ``lease_time / 4`` whatever the
progress, so a live holder on a slow link or a loaded machine keeps its lease. A lease is
only ever removed by :func:`remove_if`: renamed aside under a unique name, compared with
what the remover judged, and put back if it is not that one, so no one deletes a lease
another process has just taken or renewed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._base.safefs import SafeFS
from .._disk.layout import lease_path, lease_step_path
from .records import encode_record, read_raw, rewrite


def remove_if(fs: SafeFS, lease: Path, aside: Path, expected: Callable[[Path], bool]) -> bool:
    """Remove the lease ``lease`` if, once renamed to ``aside``, ``expected(aside)`` holds;
    otherwise put it back. True if it was removed."""
    # Rename first, then check: unlinking by name could delete a successor's lease.
    try:
        fs.replace(lease, aside)
    except FileNotFoundError:
        return False
    try:
        if expected(aside):
            return True
        with contextlib.suppress(FileExistsError):
            fs.link(aside, lease)  # renewed or replaced meanwhile: give it back
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            fs.unlink(aside)


def remove_lease_if_unchanged(fs: SafeFS, lease: Path, judged: bytes) -> bool:
    """Remove the lease ``lease`` only if it still holds exactly ``judged`` (a waiter
    breaking a stale lease, ``clean`` removing a dead one). True if it was removed."""
    lease = Path(lease)
    aside = lease_step_path(lease, secrets.token_hex(8), "broken")
    return remove_if(fs, lease, aside, lambda path: read_raw(fs, path) == judged)


def _write_new(fs: SafeFS, path: Path, record: dict[str, Any]) -> None:
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fs.trust.adopt_file(fd, fs.trust.lock_mode)
        os.write(fd, encode_record(record))
        os.fsync(fd)
    finally:
        os.close(fd)


class LeaseBackend:
    """A shard lock held as the lease file ``<hash>.lease`` (see the module)."""

    expires = True  # a silent lease is broken by waiters, so the holder renews it

    def __init__(
        self,
        fs: SafeFS,
        path: Path,
        *,
        token: str,
        new_record: Callable[..., dict[str, Any]],
    ) -> None:
        self.fs = fs
        self.path = path
        self.record_path = lease_path(path)
        self._token = token  # names our claim and release files: no two holders share one
        self._new_record = new_record
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        claim = lease_step_path(self.path, self._token, "claim")
        _write_new(self.fs, claim, self._new_record(phase="claiming", attempts=0, waited=0.0))
        try:
            try:
                self.fs.link(claim, self.record_path)
            except FileExistsError:
                return False
            except OSError:
                # NFS may report failure for a link that happened: the link count tells.
                if self.fs.lstat(claim).st_nlink != 2:
                    raise
            fd = self.fs.open(self.record_path, os.O_RDWR | os.O_NONBLOCK)
            if os.fstat(fd).st_ino != self.fs.lstat(claim).st_ino:
                os.close(fd)
                return False
            self._fd = fd
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.fs.unlink(claim)

    def watch_release(self) -> None:
        return None  # a lease's removal on another node is seen only by looking: poll

    def open_record(self) -> None:
        pass  # the lease is its own record, open since it was taken

    def write_record(self, data: bytes) -> bool:
        fd = self._fd
        assert fd is not None
        try:
            rewrite(fd, data)
            os.fsync(fd)  # make the renewal visible to other NFS clients
            return _same_file(self.fs, self.record_path, fd)  # still ours, not a successor's
        except FileNotFoundError:  # the lease was renamed away (broken) or its dir removed
            return False

    def break_stale(self, judged: bytes) -> bool:
        return remove_lease_if_unchanged(self.fs, self.record_path, judged)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        aside = lease_step_path(self.path, self._token, "released")
        try:
            # Only a lease still ours goes: one broken and re-taken meanwhile is a successor's.
            remove_if(self.fs, self.record_path, aside, lambda p: _same_file(self.fs, p, fd))
        finally:
            os.close(fd)


def _same_file(fs: SafeFS, path: Path, fd: int) -> bool:
    return fs.lstat(path).st_ino == os.fstat(fd).st_ino


class Renewer:
    """Calls ``renew`` every ``interval`` seconds until stopped (a daemon thread), so a live
    holder keeps its lease however slow its link or busy its machine."""

    def __init__(self, renew: Callable[[], None], interval: float) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(renew, interval),
            name=f"shardcache-lease-{threading.current_thread().name}",
            daemon=True,
        )
        self._thread.start()

    def _run(self, renew: Callable[[], None], interval: float) -> None:
        while not self._stopped.wait(interval):
            renew()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
