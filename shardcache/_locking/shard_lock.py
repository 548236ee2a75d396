"""Per-shard, stale-lock-aware locks: the wait, the judgement of the holder and the timeout.

The lock only avoids downloading a shard twice. Correctness never depends on it: every
writer downloads into its own temp file and publishes with an atomic rename, so even two
holders at once (a broken lease that was in fact alive) cost bandwidth, never data.

:class:`ShardLock` waits (backoff with jitter, :mod:`shardcache._locking.policy`) for one of two
backends (:class:`~shardcache._locking.backend.LockBackend`):

* ``flock`` (local disks, :mod:`shardcache._locking.flock`): the kernel frees the lock of a dead
  holder at once, so "stale" here means *stuck*: the holder's progress (phase, bytes in
  ``<hash>.owner``) has not changed for ``stuck_after`` on the waiter's own clock.
* ``lease`` (network file systems, :mod:`shardcache._locking.lease`): a waiter breaks a lease
  whose holder is provably dead (same host and boot, pid gone or reused) at once, or one
  whose record has not changed for ``lease_time`` on the waiter's clock (clocks of
  different hosts are never compared). A live holder that makes no progress for
  ``stuck_after`` gives waiters a ``LockTimeout``, as in flock mode.

In lease mode a **node-local flock comes first** (``node_lock``, a file on a node-local disk:
:mod:`shardcache._locking.node_lock`): only its holder contends for the lease on the shared file
system; the other processes of the node wait on the local lock (a flock: a SIGKILLed local
holder is freed by the kernel at once) and look for the published shard at the lease's
gentler pace. While the local holder itself waits for another node's lease, it copies that
holder's progress (phase, bytes) into its own local record, so its local waiters see the
remote download's progress as progress and do not give up on it as stuck; a remote holder
that is really stuck times out the local holder first (which releases the local lock), then
each local waiter in turn. One hard deadline (``timeout``) covers both waits. The lease's
own rules (dead holders, silent leases, breaking) are unchanged.

The holder's record (:mod:`shardcache._locking.records`) is kept here: written on acquisition,
on progress (rate-limited) and, for a lease, on each renewal.

Creating a lock file can fail transiently on network file systems (a directory another
node just made is not visible yet, ESTALE, EIO); those are retried with backoff to a
bound. Anything else, or a transient error that persists, raises :class:`LockFileError`
at once with the path and errno: never a ``LockTimeout`` that blames an unknown holder (both
errors are built in :mod:`shardcache._locking.errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .._base.errors import CacheDirError
from .._base.redact import get_logger
from .._base.safefs import SafeFS
from .._base.trust import Trust
from .._disk.layout import lease_path, owner_path
from .._observe import metrics
from .._retry.policy import RetryPolicy
from .backend import LockBackend
from .errors import CREATE_TRANSIENT_ERRNOS, lock_file_error, lock_timeout
from .flock import FlockBackend
from .lease import LeaseBackend, Renewer
from .pause import Pause, paced
from .policy import LockPolicy
from .records import (
    RecordWatch,
    describe_holder,
    encode_record,
    holder_name,
    holder_verdict,
    new_record,
    read_raw,
)

logger = get_logger(__name__)

STILL_WAITING_EVERY = 30.0
RECORD_INTERVAL = 0.5  # seconds between progress-record writes while holding
RENEWALS_PER_LEASE = 4  # a lease is renewed this many times per lease_time
# At most ~2 s in all (5 ms doubling to 0.25 s); then the error is reported, not waited out.
CREATE_RETRY = RetryPolicy(retries=12, backoff=0.005, max_backoff=0.25)


class ShardLock:
    """One acquisition of the lock guarding one shard; use :meth:`hold`.

    In lease mode with ``node_lock`` (a path on a node-local disk, in ``node_fs``), the
    node-local flock is taken first and the lease only by its holder (see the module).
    Create a new instance per acquisition: instances are not shared between threads.
    """

    def __init__(
        self,
        path: Path,
        *,
        url: str,
        policy: LockPolicy,
        rank: int = 0,
        on_wait: Callable[[dict[str, Any] | None], None] | None = None,
        fs: SafeFS | None = None,
        node_lock: Path | None = None,
        node_fs: SafeFS | None = None,
    ) -> None:
        self.path = Path(path)
        # Every file operation goes through the cache's directory descriptors; a lock used
        # on its own is rooted at its directory.
        self.fs = SafeFS(self.path.parent, Trust.private()) if fs is None else fs
        # Called with the holder's record each time it changes while we wait (and at the
        # first wait, with None if the holder has no record yet), so observers (the
        # prefetch watchdog, the prefetcher's first shard) see another process's progress.
        self.on_wait = on_wait
        self.url = url
        self.policy = policy
        self.rank = rank
        self._token = secrets.token_hex(8)
        self._backend: LockBackend = (
            LeaseBackend(self.fs, self.path, token=self._token, new_record=self._make_record)
            if policy.mode == "lease"
            else FlockBackend(self.fs, self.path)
        )
        self._record: dict[str, Any] = {}
        self._recording = False  # the record is open for writing (held, not released)
        self._last_write = 0.0
        self._write_lock = threading.Lock()  # the holder's thread and the renewal thread
        self._renewer: Renewer | None = None
        self.record_error: str | None = None  # why the owner record could not be written
        self.lost = False  # lease mode: True once another process broke our lease
        self.fronts: Path | None = None  # a node lock: the lease it stands in front of
        # Holder records of the waits of the acquisition in progress (for the metrics).
        self._waited_for: list[dict[str, Any] | None] = []
        # Lease mode: the node-local flock taken before the lease (see the module).
        self.node_lock: ShardLock | None = None
        if node_lock is not None and policy.mode == "lease":
            self.node_lock = ShardLock(
                node_lock,
                url=url,
                policy=dataclasses.replace(policy, mode="flock"),
                rank=rank,
                on_wait=on_wait,
                fs=node_fs,
            )
            self.node_lock.fronts = self.lease_path

    @property
    def owner_path(self) -> Path:
        return owner_path(self.path)

    @property
    def lease_path(self) -> Path:
        return lease_path(self.path)

    @contextlib.contextmanager
    def hold(self, done: Callable[[], bool] | None = None) -> Iterator[bool]:
        """Hold the lock for the ``with`` block; yields False (not held) if ``done()`` turned
        true while waiting (another process published the shard)."""
        acquired = self.acquire(done)
        try:
            yield acquired
        finally:
            if acquired:
                self.release()

    # -- acquisition -------------------------------------------------------------------

    def acquire(self, done: Callable[[], bool] | None = None) -> bool:
        """Wait for the lock (backoff with jitter). False if ``done()`` became true first.
        A wait (the lock was not free at once) is counted in the loader metrics with the
        holder it waited for."""
        start = time.monotonic()
        self._waited_for = []
        if self.node_lock is not None:
            self.node_lock._waited_for = []
        try:
            return self._acquire(done, start)
        finally:
            waited = self._waited_for
            if self.node_lock is not None:
                waited = self.node_lock._waited_for + waited
            if waited:
                holder = next((r for r in reversed(waited) if r), None)
                metrics.collector().lock_wait(time.monotonic() - start, holder_name(holder))

    def _acquire(self, done: Callable[[], bool] | None, start: float) -> bool:
        node = self.node_lock
        if node is None:
            return self._wait(done, start, self.on_wait)
        # Waiting on the node lock costs the shared file system only done()'s look at the
        # published shard, taken at the lease's pace rather than the local lock's.
        if not node._wait(paced(done, *self.policy.backoff), start, node.on_wait):
            return False
        try:
            if done is not None and done():  # published while we waited locally
                node.release()
                return False
            acquired = self._wait(done, start, self._waiting_for_lease)
        except BaseException:
            node.release()
            raise
        if not acquired:
            node.release()
        return acquired

    def _waiting_for_lease(self, record: dict[str, Any] | None) -> None:
        """The node lock's holder waits for another holder's lease: its progress is copied
        into the node lock's record, for the local waiters to see (see the module)."""
        if self.on_wait is not None:
            self.on_wait(record)
        assert self.node_lock is not None
        if record is None:
            phase = "waiting for the lease (no holder record)"
        else:
            phase = (
                f"waiting for the lease of pid {record.get('pid')} on {record.get('host')} "
                f"({record.get('phase')})"
            )
        self.node_lock.heartbeat(
            phase=phase,
            bytes_done=int((record or {}).get("bytes_done") or 0),
            bytes_total=(record or {}).get("bytes_total"),
        )

    def _wait(
        self,
        done: Callable[[], bool] | None,
        start: float,
        on_wait: Callable[[dict[str, Any] | None], None] | None,
    ) -> bool:
        """Wait for this lock alone; ``start`` is when the whole acquisition began."""
        delay, max_delay = self.policy.backoff
        watch = RecordWatch()
        pause = Pause(self._backend, self.path)
        attempts = 0
        next_log = start + STILL_WAITING_EVERY
        while True:
            attempts += 1
            if self._try_acquire():
                self._start_record(attempts, time.monotonic() - start)
                self._note_wait(attempts, watch)
                return True
            if done is not None and done():
                self._note_wait(attempts + 1, watch)
                return False
            now = time.monotonic()
            raw = self._read_holder_raw()
            # The first failed attempt is reported even before the holder's record exists
            # (None): a waiter's progress then says at once that it waits for a lock.
            if (watch.observe(raw, now) or attempts == 1) and on_wait is not None:
                on_wait(watch.record)
            self._judge(watch, now, start, attempts)
            if now >= next_log:
                logger.info(
                    "still waiting for the lock of %s after %.0fs (%s)",
                    self.url,
                    now - start,
                    describe_holder(watch.record),
                )
                next_log = now + STILL_WAITING_EVERY
            remaining = start + self.policy.timeout - now
            pause(max(0.0, min(remaining, delay * random.uniform(0.5, 1.5))))
            delay = min(max_delay, delay * 2)

    def _note_wait(self, attempts: int, watch: RecordWatch) -> None:
        if attempts > 1:
            self._waited_for.append(watch.record)

    def _try_acquire(self) -> bool:
        """One attempt at the lock. Transient creation errors are retried with backoff
        (bounded by CREATE_RETRY); anything else raises LockFileError at once."""

        def attempt(_n: int) -> bool:
            self.fs.mkdirs(self.path.parent)
            return self._backend.try_acquire()

        def transient(exc: Exception) -> bool:
            mine = isinstance(exc, CacheDirError)  # already says what is wrong
            return isinstance(exc, OSError) and not mine and exc.errno in CREATE_TRANSIENT_ERRNOS

        def give_up(exc: Exception, attempts: int) -> BaseException:
            if isinstance(exc, OSError) and not isinstance(exc, CacheDirError):
                return lock_file_error(self.path, self.url, exc, attempts)
            return exc

        return CREATE_RETRY.run(
            attempt,
            retry_if=transient,
            give_up=give_up,
            on_retry=lambda exc, n: logger.debug(
                "creating %s: %s (attempt %d), retrying", self.path, exc, n
            ),
        )

    # -- judging the holder --------------------------------------------------------------

    def _read_holder_raw(self) -> bytes | None:
        return read_raw(self.fs, self._backend.record_path)

    def _judge(self, watch: RecordWatch, now: float, start: float, attempts: int) -> None:
        verdict, why = holder_verdict(watch.record)
        quiet = now - watch.changed_at
        still = now - watch.progressed_at
        expired = verdict == "dead" or quiet >= self.policy.lease_time
        if self._backend.expires and watch.raw is not None and expired:
            reason = why if verdict == "dead" else f"no renewal for {quiet:.1f}s"
            if self._backend.break_stale(watch.raw):
                logger.warning("broke the stale lease of %s: %s", self.url, reason)
            watch.reset(now)
            return
        if still >= self.policy.stuck_after and verdict != "dead":
            self._timeout(
                watch=watch,
                verdict=verdict,
                why=why,
                start=start,
                attempts=attempts,
                cause=f"the holder's progress (phase, bytes) has not changed for {still:.0f}s "
                f"(SHARDCACHE_LOCK_STUCK_AFTER={self.policy.stuck_after:g}s)",
            )
        if now - start >= self.policy.timeout:
            self._timeout(
                watch=watch,
                verdict=verdict,
                why=why,
                start=start,
                attempts=attempts,
                cause=f"waited the full SHARDCACHE_LOCK_TIMEOUT={self.policy.timeout:g}s",
            )

    def _timeout(
        self,
        *,
        watch: RecordWatch,
        verdict: str,
        why: str,
        start: float,
        attempts: int,
        cause: str,
    ) -> None:
        raise lock_timeout(
            path=self.path,
            url=self.url,
            mode=self.policy.mode,
            rank=self.rank,
            fronts=self.fronts,
            record_path=self._backend.record_path,
            owner=watch.record,
            verdict=verdict,
            why=why,
            elapsed=time.monotonic() - start,
            attempts=attempts,
            cause=cause,
        )

    # -- holding -------------------------------------------------------------------------

    def _make_record(self, **extra: Any) -> dict[str, Any]:
        return new_record(rank=self.rank, token=self._token, url=self.url, **extra)

    def _start_record(self, attempts: int, waited: float) -> None:
        self._record = self._make_record(phase="locked", attempts=attempts, waited=waited)
        try:
            self._backend.open_record()
        except OSError as exc:
            # The lock is held all the same; only what waiters can tell about us suffers.
            self._record_failed(exc)
            return
        self._recording = True
        self._write_record()
        if self._backend.expires:
            self._renewer = Renewer(self.renew, self.policy.lease_time / RENEWALS_PER_LEASE)

    def heartbeat(
        self,
        *,
        phase: str | None = None,
        bytes_done: int | None = None,
        bytes_total: int | None = None,
    ) -> None:
        """Record progress; rate-limited unless the phase changes. Call while holding."""
        if not self._recording:
            return
        phase_changed = phase is not None and phase != self._record.get("phase")
        if not phase_changed and time.monotonic() - self._last_write < self._record_interval:
            return
        with self._write_lock:
            if phase is not None:
                self._record["phase"] = phase
            if bytes_done is not None:
                self._record["bytes_done"] = bytes_done
            if bytes_total is not None:
                self._record["bytes_total"] = bytes_total
            self._record["seq"] += 1
            self._write_record()
        if self.node_lock is not None:  # local waiters judge progress from the node lock
            self.node_lock.heartbeat(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)

    @property
    def _record_interval(self) -> float:
        # A lease must change well within lease_time even if renewals were late.
        if self._backend.expires:
            return min(RECORD_INTERVAL, self.policy.lease_time / RENEWALS_PER_LEASE)
        return RECORD_INTERVAL

    def renew(self) -> None:
        """Rewrite the lease record without progress (the renewal thread calls this)."""
        with self._write_lock:
            if not self._recording:
                return
            self._record["renewals"] = self._record.get("renewals", 0) + 1
            self._write_record()

    def _write_record(self) -> None:
        if not self._recording:
            return
        try:
            if not self._backend.write_record(encode_record(self._record)):
                self._lease_lost()
        except OSError as exc:
            self._record_failed(exc)
        self._last_write = time.monotonic()

    def _lease_lost(self) -> None:
        if not self.lost:
            self.lost = True
            logger.warning(
                "lost the lease of %s (broken by another process, or its directory was "
                "removed); the download continues and publishes atomically",
                self.url,
            )

    def _record_failed(self, exc: OSError) -> None:
        """Log once per acquisition; waiters then see an old or missing record."""
        if self.record_error is None:
            self.record_error = f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc}"
            logger.warning(
                "cannot write the lock owner record of %s beside %s (%s): waiters will see "
                "the holder as unknown or not progressing; check free space and permissions "
                "of %s",
                self.url,
                self.path,
                self.record_error,
                self.path.parent,
            )

    def release(self) -> None:
        """Release the lock (lock files stay; a lease we still own is removed)."""
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()
        with self._write_lock:
            self._recording = False  # no record write may reach a released lock
        try:
            self._backend.release()
        finally:
            if self.node_lock is not None:
                self.node_lock.release()
