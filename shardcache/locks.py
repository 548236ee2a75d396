"""Per-shard, stale-lock-aware locks.

The lock only avoids downloading a shard twice. Correctness never depends on it: every
writer downloads into its own temp file and publishes with an atomic rename, so even two
holders at once (a broken lease that was in fact alive) cost bandwidth, never data.

Two modes:

* ``flock`` (local disks): ``fcntl.flock`` on ``<hash>.lock``, taken directly rather than
  through ``filelock``, whose behaviour changed across versions (lock-file removal on
  release, a silent fallback to a soft lock): these invariants are ours to keep. The kernel
  frees the lock of a dead holder at once, so "stale" here means *stuck*: the holder's
  progress (phase, bytes in ``<hash>.owner``) has not changed for ``stuck_after`` on the
  waiter's own clock. Lock files are never deleted: unlinking a locked file lets the next
  contender lock a new inode while the old holder still holds the old one (two holders).
* ``lease`` (network file systems, where flock may silently exclude only within a node):
  the lock *is* the file ``<hash>.lease``, created atomically with ``os.link`` from a
  private claim file holding the owner record. The holder rewrites the record as it makes
  progress, and a renewal thread rewrites it every ``lease_time / 4`` whatever the
  progress, so a live holder on a slow link or a loaded machine keeps its lease. A waiter
  breaks a lease whose holder is provably dead (same host and boot, pid gone or reused) at
  once, or one whose record has not changed for ``lease_time`` on the waiter's clock
  (clocks of different hosts are never compared). Breaking renames the lease to a unique
  name and checks that it is still the record that was judged. A live holder that makes
  no progress for ``stuck_after`` gives waiters a ``LockTimeout``, as in flock mode.

Creating a lock file can fail transiently on network file systems (a directory another
node just made is not visible yet, ESTALE, EIO); those are retried with backoff to a
bound. Anything else, or a transient error that persists, raises :class:`LockFileError`
at once with the path and errno: never a ``LockTimeout`` that blames an unknown holder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import SPECS
from .dirs import NOT_YET_ERRNOS
from .errors import CacheDirError, LockFileError, LockTimeout
from .fsinfo import mount_for
from .identity import ProcessIdentity
from .redact import get_logger, redact_url
from .retry import RetryPolicy
from .safefs import SafeFS
from .trust import Trust

logger = get_logger(__name__)

STILL_WAITING_EVERY = 30.0
RECORD_INTERVAL = 0.5  # seconds between progress-record writes while holding
RENEWALS_PER_LEASE = 4  # a lease is renewed this many times per lease_time
# Errors that may clear by themselves while creating a lock file: the "not yet" errors of
# a shared file system, and a claim name that is still being removed (EEXIST).
_TRANSIENT_ERRNOS = NOT_YET_ERRNOS | {errno.EEXIST}
# At most ~2 s in all (5 ms doubling to 0.25 s); then the error is reported, not waited out.
CREATE_RETRY = RetryPolicy(retries=12, backoff=0.005, max_backoff=0.25)
_UNSUPPORTED_ERRNOS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP})
_CONTENTION_ERRNOS = frozenset({errno.EACCES, errno.EAGAIN, errno.EWOULDBLOCK})


@dataclass(frozen=True, kw_only=True)
class LockPolicy:
    """How long and how to wait for a shard lock."""

    mode: str = "flock"  # "flock" or "lease"
    # Defaults from the settings' specs (one place): SHARDCACHE_LOCK_TIMEOUT (hard limit on
    # the wait), _LOCK_STUCK_AFTER (give up on a holder whose progress record did not
    # change), _LEASE_TIME (break a lease whose record did not change).
    timeout: float = SPECS["lock_timeout"].default
    stuck_after: float = SPECS["lock_stuck_after"].default
    lease_time: float = SPECS["lease_time"].default

    @property
    def backoff(self) -> tuple[float, float]:
        """(first, max) poll delay: short on local disks, gentler on shared ones."""
        if self.mode == "lease":
            return 0.05, max(0.05, min(10.0, self.lease_time / 4))
        return 0.01, 1.0


class ShardLock:
    """One acquisition of the lock guarding one shard; use :meth:`hold`.

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
    ) -> None:
        self.path = Path(path)
        # Every file operation goes through the cache's directory descriptors; a lock used
        # on its own is rooted at its directory.
        self.fs = SafeFS(self.path.parent, Trust.private()) if fs is None else fs
        # Called with the holder's record each time it changes while we wait, so observers
        # (the prefetch watchdog) see another process's progress as progress.
        self.on_wait = on_wait
        self.url = url
        self.policy = policy
        self.rank = rank
        self._token = secrets.token_hex(8)
        self._record: dict[str, Any] = {}
        self._record_fd: int | None = None
        self._last_write = 0.0
        self._flock_fd: int | None = None
        self._write_lock = threading.Lock()  # the holder's thread and the renewal thread
        self._renewer: _Renewer | None = None
        self.record_error: str | None = None  # why the owner record could not be written
        self.lost = False  # lease mode: True once another process broke our lease

    @property
    def owner_path(self) -> Path:
        return self.path.with_suffix(".owner")

    @property
    def lease_path(self) -> Path:
        return self.path.with_suffix(".lease")

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
        """Wait for the lock (backoff with jitter). False if ``done()`` became true first."""
        start = time.monotonic()
        delay, max_delay = self.policy.backoff
        watch = _RecordWatch()
        attempts = 0
        next_log = start + STILL_WAITING_EVERY
        while True:
            attempts += 1
            if self._try_acquire():
                self._start_record(attempts, time.monotonic() - start)
                return True
            if done is not None and done():
                return False
            now = time.monotonic()
            raw = self._read_holder_raw()
            if watch.observe(raw, now) and self.on_wait is not None:
                self.on_wait(watch.record)
            self._judge(watch, now, start, attempts)
            if now >= next_log:
                logger.info(
                    "still waiting for the lock of %s after %.0fs (%s)",
                    self.url,
                    now - start,
                    _summarise(watch.record),
                )
                next_log = now + STILL_WAITING_EVERY
            remaining = start + self.policy.timeout - now
            time.sleep(max(0.0, min(remaining, delay * random.uniform(0.5, 1.5))))
            delay = min(max_delay, delay * 2)

    def _try_acquire(self) -> bool:
        """One attempt at the lock. Transient creation errors are retried with backoff
        (bounded by CREATE_RETRY); anything else raises LockFileError at once."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self.fs.mkdirs(self.path.parent)
                if self.policy.mode == "lease":
                    return self._try_claim_lease()
                return self._try_flock()
            except CacheDirError:
                raise
            except OSError as exc:
                transient = exc.errno in _TRANSIENT_ERRNOS
                if not transient or not CREATE_RETRY.allows(attempt):
                    raise lock_file_error(self.path, self.url, exc, attempt) from exc
                logger.debug("creating %s: %s (attempt %d), retrying", self.path, exc, attempt)
                time.sleep(CREATE_RETRY.delay(attempt))

    def _try_flock(self) -> bool:
        self._flock_fd = try_flock(self.fs, self.path)
        return self._flock_fd is not None

    def _try_claim_lease(self) -> bool:
        claim = self.path.with_name(f"{self.path.stem}.{self._token}.claim")
        record = self._make_record(phase="claiming", attempts=0, waited=0.0)
        _write_new(self.fs, claim, record)
        try:
            try:
                self.fs.link(claim, self.lease_path)
            except FileExistsError:
                return False
            except OSError:
                # NFS may report failure for a link that happened: the link count tells.
                if self.fs.lstat(claim).st_nlink != 2:
                    raise
            fd = self.fs.open(self.lease_path, os.O_RDWR | os.O_NONBLOCK)
            if os.fstat(fd).st_ino != self.fs.lstat(claim).st_ino:
                os.close(fd)
                return False
            self._record_fd = fd
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.fs.unlink(claim)

    # -- judging the holder --------------------------------------------------------------

    def _read_holder_raw(self) -> bytes | None:
        path = self.lease_path if self.policy.mode == "lease" else self.owner_path
        return _read_raw(self.fs, path)

    def _judge(self, watch: _RecordWatch, now: float, start: float, attempts: int) -> None:
        verdict, why = _verdict(watch.record)
        quiet = now - watch.changed_at
        still = now - watch.progressed_at
        expired = verdict == "dead" or quiet >= self.policy.lease_time
        if self.policy.mode == "lease" and watch.raw is not None and expired:
            reason = why if verdict == "dead" else f"no renewal for {quiet:.1f}s"
            self._break_lease(watch.raw, reason)
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

    def _break_lease(self, judged: bytes, reason: str) -> None:
        if remove_lease_if_unchanged(self.fs, self.lease_path, judged):
            logger.warning("broke the stale lease of %s: %s", self.url, reason)

    def _timeout(
        self,
        *,
        watch: _RecordWatch,
        verdict: str,
        why: str,
        start: float,
        attempts: int,
        cause: str,
    ) -> None:
        elapsed = time.monotonic() - start
        owner = watch.record
        mount = mount_for(self.path)
        me = ProcessIdentity.current()
        if verdict == "alive" and owner:
            hint = (
                f"inspect the holder (py-spy dump --pid {owner.get('pid')}) or kill it: the "
                "kernel frees its lock when it exits. If its downloads are legitimately "
                "slow, raise SHARDCACHE_LOCK_STUCK_AFTER / SHARDCACHE_LOCK_TIMEOUT."
            )
        elif self.policy.mode == "flock" and mount.is_network:
            hint = (
                "the cache is on a network file system where flock can mislead; set "
                "SHARDCACHE_LOCK_MODE=lease or move SHARDCACHE_DIR to a node-local disk."
            )
        else:
            hint = (
                "check that the holder is still running and can reach the remote store; "
                "raise SHARDCACHE_LOCK_TIMEOUT if downloads are slow."
            )
        raise LockTimeout(
            f"timed out waiting for the lock of {self.url}: {cause}.\n"
            f"  lock file: {self.path} ({self.policy.mode} mode) on {mount.describe()}\n"
            f"  waiter: host {me.host} pid {me.pid} rank {self.rank} thread "
            f"{threading.current_thread().name}\n"
            f"  holder: {self._describe_holder(owner)}\n"
            f"  verdict: {verdict} ({why})\n"
            f"  waited {elapsed:.1f}s over {attempts} attempts\n"
            f"  what to do: {hint}",
            url=self.url,
            path=str(self.path),
            owner=owner,
            verdict=verdict,
            elapsed=elapsed,
            attempts=attempts,
        )

    def _describe_holder(self, owner: dict[str, Any] | None) -> str:
        if owner is not None:
            return _summarise(owner)
        record = self.lease_path if self.policy.mode == "lease" else self.owner_path
        return (
            f"unknown: no readable owner record at {record} (the holder may be unable to "
            "write it: a full disk, a read-only or unwritable directory; or it has just started)"
        )

    # -- holding -------------------------------------------------------------------------

    def _make_record(self, **extra: Any) -> dict[str, Any]:
        me = ProcessIdentity.current()
        return {
            "host": me.host,
            "boot_id": me.boot_id,
            "pidns": me.pidns,
            "pid": me.pid,
            "start_ticks": me.start_ticks,
            "rank": self.rank,
            "thread": threading.current_thread().name,
            "token": self._token,
            "url": redact_url(self.url),  # the record is on disk: no credentials
            "since": time.time(),
            "seq": 0,
            **extra,
        }

    def _start_record(self, attempts: int, waited: float) -> None:
        self._record = self._make_record(phase="locked", attempts=attempts, waited=waited)
        if self.policy.mode == "flock":
            try:
                self._record_fd = _open_shared(self.fs, self.owner_path)
            except OSError as exc:
                # The lock is held all the same; only what waiters can tell about us suffers.
                self._record_failed(exc)
                return
        self._write_record()
        if self.policy.mode == "lease":
            self._renewer = _Renewer(self, self.policy.lease_time / RENEWALS_PER_LEASE)

    def heartbeat(
        self,
        *,
        phase: str | None = None,
        bytes_done: int | None = None,
        bytes_total: int | None = None,
    ) -> None:
        """Record progress; rate-limited unless the phase changes. Call while holding."""
        if self._record_fd is None:
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

    @property
    def _record_interval(self) -> float:
        # A lease must change well within lease_time even if renewals were late.
        if self.policy.mode == "lease":
            return min(RECORD_INTERVAL, self.policy.lease_time / RENEWALS_PER_LEASE)
        return RECORD_INTERVAL

    def renew(self) -> None:
        """Rewrite the lease record without progress (the renewal thread calls this)."""
        with self._write_lock:
            if self._record_fd is None:
                return
            self._record["renewals"] = self._record.get("renewals", 0) + 1
            self._write_record()

    def _write_record(self) -> None:
        fd = self._record_fd
        if fd is None:
            return
        data = json.dumps(self._record, sort_keys=True).encode()
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            if self.policy.mode == "lease":
                os.fsync(fd)  # make the renewal visible to other NFS clients
                if self.fs.lstat(self.lease_path).st_ino != os.fstat(fd).st_ino:
                    self._lease_lost()
        except FileNotFoundError:  # the lease was renamed away (broken) or its dir removed
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
            fd, self._record_fd = self._record_fd, None
        flock_fd, self._flock_fd = self._flock_fd, None
        try:
            if self.policy.mode == "lease" and fd is not None:
                self._release_lease(fd)
        finally:
            if fd is not None:
                os.close(fd)
            if flock_fd is not None:
                os.close(flock_fd)  # closing the last descriptor releases the flock

    def _release_lease(self, fd: int) -> None:
        # Rename first, then check: unlinking by name could delete a successor's lease.
        aside = self.path.with_name(f"{self.path.stem}.{self._token}.released")
        try:
            self.fs.replace(self.lease_path, aside)
        except FileNotFoundError:
            return
        try:
            if self.fs.lstat(aside).st_ino != os.fstat(fd).st_ino:
                with contextlib.suppress(FileExistsError):
                    self.fs.link(aside, self.lease_path)  # not ours: give it back
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.fs.unlink(aside)


class _Renewer:
    """Renews a held lease every ``interval`` seconds until stopped (a daemon thread), so a
    live holder keeps its lease however slow its link or busy its machine."""

    def __init__(self, lock: ShardLock, interval: float) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(lock, interval),
            name=f"shardcache-lease-{threading.current_thread().name}",
            daemon=True,
        )
        self._thread.start()

    def _run(self, lock: ShardLock, interval: float) -> None:
        while not self._stopped.wait(interval):
            lock.renew()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def lock_file_error(path: Path, url: str | None, exc: OSError, attempts: int) -> LockFileError:
    """The error for a lock file that cannot be created or locked: path, errno, what to do."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, str(code))
    where = exc.filename or path
    if code in _UNSUPPORTED_ERRNOS:
        what = (
            f"flock is not supported on {mount_for(path).describe()}; set "
            "SHARDCACHE_LOCK_MODE=lease for this file system"
        )
    elif code == errno.ELOOP:
        what = (
            "a symbolic link stands where the lock file belongs (lock files are never "
            "followed out of the cache): remove it"
        )
    elif code in (errno.ENOSPC, errno.EDQUOT):
        what = "the disk or quota is full: free space on it or move SHARDCACHE_DIR"
    elif code == errno.EROFS:
        what = (
            "the file system is read-only (mounted so, or remounted read-only after errors): "
            "check it (dmesg) or point SHARDCACHE_DIR at a writable disk"
        )
    elif code in _TRANSIENT_ERRNOS:
        what = (
            f"the error persisted over {attempts} attempts; something keeps removing the "
            "cache's directories, or the (network) file system is failing: check it and "
            "the tmp cleaners of this node"
        )
    else:
        what = "check that the cache directory is writable (SHARDCACHE_DIR)"
    for_url = f" for {url}" if url else ""
    return LockFileError(
        f"cannot create or lock the lock file {path}{for_url}: {name} "
        f"({exc.strerror or exc}) at {where}; expected a writable lock directory. "
        f"What to do: {what}.",
        path=str(path),
        url=url,
        errno=code,
        attempts=attempts,
        cause=f"{name}: {exc.strerror or exc}",
    )


def _open_shared(fs: SafeFS, path: Path, access: int = os.O_RDWR) -> int:
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
    fd = _open_shared(fs, path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _CONTENTION_ERRNOS:
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


class _RecordWatch:
    """Tracks, on this process's monotonic clock, when a holder's record last changed at
    all (liveness: lease renewals count) and when its progress last changed (stuckness)."""

    def __init__(self) -> None:
        self.raw: bytes | None = None
        self.record: dict[str, Any] | None = None
        self.changed_at = self.progressed_at = time.monotonic()
        self._progress: object = None

    def observe(self, raw: bytes | None, now: float) -> bool:
        """Note the holder's current record; True if it changed."""
        if raw == self.raw:
            return False
        self.raw = raw
        self.record = _parse_record(raw)
        self.changed_at = now
        progress = _progress_of(self.record, raw)
        if progress != self._progress:
            self._progress = progress
            self.progressed_at = now
        return True

    def reset(self, now: float) -> None:
        self.raw, self.record, self._progress = None, None, None
        self.changed_at = self.progressed_at = now


def _progress_of(record: dict[str, Any] | None, raw: bytes | None) -> object:
    """What changes only when a holder makes progress (not when it merely renews)."""
    if record is None:
        return raw
    return tuple(record.get(k) for k in ("token", "phase", "bytes_done", "bytes_total"))


_UNREADABLE = b"\0unreadable"  # a record that exists but cannot be read (a link, no access)


def _read_raw(fs: SafeFS, path: Path) -> bytes | None:
    """A record's bytes, never following a symbolic link; None if there is none."""
    try:
        return fs.read_small(path)
    except FileNotFoundError:
        return None
    except OSError:  # a link, a FIFO, no access: judged like garbage (expires, then broken)
        return _UNREADABLE


def _write_new(fs: SafeFS, path: Path, record: dict[str, Any]) -> None:
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fs.trust.adopt_file(fd, fs.trust.lock_mode)
        os.write(fd, json.dumps(record, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _parse_record(raw: bytes | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _verdict(record: dict[str, Any] | None) -> tuple[str, str]:
    if record is None:
        return "unknown", "no readable owner record yet"
    try:
        holder = ProcessIdentity(
            host=str(record["host"]),
            boot_id=str(record.get("boot_id", "")),
            pidns=str(record.get("pidns", "")),
            pid=int(record["pid"]),
            start_ticks=record.get("start_ticks"),
        )
    except (KeyError, TypeError, ValueError):
        return "unknown", "the owner record is malformed"
    return holder.liveness()


def _summarise(record: dict[str, Any] | None) -> str:
    if not record:
        return "unknown (no readable owner record)"
    age = time.time() - float(record.get("since", time.time()))
    done, total = record.get("bytes_done"), record.get("bytes_total")
    progress = f", {done}/{total} bytes" if done is not None else ""
    return (
        f"host {record.get('host')} pid {record.get('pid')} rank {record.get('rank')} "
        f"thread {record.get('thread')}, phase {record.get('phase')}{progress}, "
        f"held for {age:.0f}s (by its clock)"
    )


# -- inspection (``shardcache status`` / ``clean``) ---------------------------------------


def read_record(fs: SafeFS, path: Path) -> tuple[bytes | None, dict[str, Any] | None]:
    """The raw bytes of an owner/lease/claim record and its parsed form (None if unreadable)."""
    try:
        raw = fs.read_small(Path(path))
    except OSError:
        return None, None
    return raw, _parse_record(raw)


def read_owner(fs: SafeFS, lock_path: Path) -> dict[str, Any] | None:
    """The owner record (``<hash>.owner``) beside the flock file ``lock_path``, if readable."""
    return read_record(fs, Path(lock_path).with_suffix(".owner"))[1]


def holder_verdict(record: dict[str, Any] | None) -> tuple[str, str]:
    """("alive" | "dead" | "unknown", why) for the process a lock record names."""
    return _verdict(record)


def describe_holder(record: dict[str, Any] | None) -> str:
    """One line about a lock record's holder: host, pid, rank, thread, phase, bytes, age."""
    return _summarise(record)


def is_held(fs: SafeFS, lock_path: Path) -> bool | None:
    """Whether some process holds the flock on ``lock_path`` right now (None: cannot tell).

    Probes with a non-blocking ``flock`` on a fresh descriptor, released at once; never
    creates or deletes the file. A holder in this very process counts as holding it.
    """
    try:
        fd = fs.open(lock_path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return True if exc.errno in _CONTENTION_ERRNOS else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def remove_lease_if_unchanged(fs: SafeFS, lease_path: Path, judged: bytes) -> bool:
    """Remove the lease ``lease_path`` only if it still holds exactly ``judged``.

    Like breaking a stale lease while waiting: rename it aside, compare, and put it back
    if its holder renewed it meanwhile. True if it was removed.
    """
    lease_path = Path(lease_path)
    aside = lease_path.with_name(f"{lease_path.stem}.{secrets.token_hex(8)}.broken")
    try:
        fs.replace(lease_path, aside)
    except FileNotFoundError:
        return False
    try:
        if _read_raw(fs, aside) == judged:
            return True
        with contextlib.suppress(FileExistsError):
            fs.link(aside, lease_path)  # renewed or replaced meanwhile: give it back
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            fs.unlink(aside)
