"""Locks under real adverse conditions: a read-only lock directory, a full disk, a loaded
machine with the smallest accepted lease time."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
from mounts import fill, needs_root, read_only, tmpfs
from processes import collect, wait_set

from shardcache import ShardCache
from shardcache._base.errors import ConfigError, LockFileError, LockTimeout
from shardcache._config.settings import Settings
from shardcache._locking.policy import LockPolicy
from shardcache._locking.shard_lock import ShardLock

CTX = mp.get_context("spawn")
PATIENT = {"timeout": 3600.0, "stuck_after": 3600.0, "lease_time": 3600.0}


@needs_root
@pytest.mark.parametrize("mode", ["flock", "lease"])
def test_read_only_lock_directory_fails_at_once_with_path_and_errno(
    tmp_path: Path, mode: str
) -> None:
    locks = tmp_path / ".locks" / "ab"
    locks.mkdir(parents=True)
    lock = ShardLock(locks / "x.lock", url="s3://b/k", policy=LockPolicy(mode=mode, **PATIENT))
    with read_only(locks), pytest.raises(LockFileError) as info:
        lock.acquire()
    err = info.value
    # Not a LockTimeout after an hour: a persistent error is reported on the first attempt.
    assert not isinstance(err, LockTimeout)
    assert err.errno == errno.EROFS and err.attempts == 1
    assert str(locks / "x.lock") in str(err) and "EROFS" in str(err)
    assert "writable" in str(err)


@needs_root
def test_fetch_into_read_only_lock_tree_raises_lock_file_error(tmp_path: Path) -> None:
    src = tmp_path / "shard.tar"
    src.write_bytes(b"x" * 1000)
    cache = ShardCache(tmp_path / "cache", scope="node", lock_mode="flock", lock_timeout=3600)
    lock_dir = cache._identify(str(src)).lock_path.parent
    lock_dir.mkdir(parents=True)
    with read_only(lock_dir), pytest.raises(LockFileError) as info:
        cache.fetch(str(src))
    assert info.value.errno == errno.EROFS
    assert not cache.contains(str(src))


@needs_root
def test_full_disk_lease_claim_fails_at_once(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "64k") as fs:
        fill(fs)
        lock = ShardLock(fs / "x.lock", url="s3://b/k", policy=LockPolicy(mode="lease", **PATIENT))
        with pytest.raises(LockFileError) as info:
            lock.acquire()
    assert info.value.errno == errno.ENOSPC and info.value.attempts == 1
    assert "full" in str(info.value)


@needs_root
def test_owner_record_failure_is_logged_once_and_shown_to_waiters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tmpfs(tmp_path / "fs", "64k") as fs:
        fill(fs)  # the lock file itself needs no blocks; its owner record does
        holder = ShardLock(
            fs / "x.lock", url="s3://b/k", policy=LockPolicy(mode="flock", **PATIENT)
        )
        with caplog.at_level(logging.WARNING, logger="shardcache._locking.shard_lock"):
            assert holder.acquire()
            try:
                for n in range(5):
                    holder.heartbeat(phase=f"phase {n}", bytes_done=n, bytes_total=10)
                waiter = ShardLock(
                    fs / "x.lock",
                    url="s3://b/k",
                    policy=LockPolicy(mode="flock", timeout=3600, stuck_after=0.2),
                )
                with pytest.raises(LockTimeout) as info:
                    waiter.acquire()
            finally:
                holder.release()
    warnings = [r for r in caplog.records if "cannot write the lock owner record" in r.message]
    assert len(warnings) == 1
    assert "ENOSPC" in warnings[0].getMessage()
    assert holder.record_error is not None and "ENOSPC" in holder.record_error
    assert f"no readable owner record at {fs / 'x.owner'}" in str(info.value)
    assert "full disk" in str(info.value)


def test_lease_time_below_renewal_margin_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        Settings.resolve(lease_time=0.5)
    assert "lease" in str(info.value).lower()
    assert Settings.resolve(lease_time=1.0).lease_time == 1.0


# ----------------------------------------------------------- a live lease under CPU load


def _burn(stop: mp.synchronize.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _hold_lease(lock_path: str, lease_time: float, held, release, out) -> None:
    lock = ShardLock(
        Path(lock_path),
        url="s3://b/k",
        policy=LockPolicy(mode="lease", **{**PATIENT, "lease_time": lease_time}),
    )
    assert lock.acquire()
    held.set()
    release.wait(120)
    lost = lock.lost
    lock.release()
    out.put(("holder", lost))


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.broken = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "broke the stale lease" in record.getMessage():
            self.broken += 1


def _wait_for_lease(lock_path: str, lease_time: float, held, out) -> None:
    counter = _Count()
    logging.getLogger("shardcache._locking.shard_lock").addHandler(counter)
    held.wait(60)
    lock = ShardLock(
        Path(lock_path),
        url="s3://b/k",
        policy=LockPolicy(mode="lease", **{**PATIENT, "lease_time": lease_time}),
    )
    assert lock.acquire()
    lock.release()
    out.put(("waiter", counter.broken))


def test_live_lease_survives_a_loaded_machine_at_the_smallest_lease_time(tmp_path: Path) -> None:
    lease_time = Settings.resolve(lease_time=1.0).lease_time  # the smallest accepted
    lock_path = tmp_path / ".locks" / "x.lock"
    lock_path.parent.mkdir(parents=True)
    stop, held, release = CTX.Event(), CTX.Event(), CTX.Event()
    out = CTX.Queue()
    burners = [CTX.Process(target=_burn, args=(stop,)) for _ in range(2 * os.cpu_count())]
    holder = CTX.Process(target=_hold_lease, args=(str(lock_path), lease_time, held, release, out))
    waiters = [
        CTX.Process(target=_wait_for_lease, args=(str(lock_path), lease_time, held, out))
        for _ in range(3)
    ]
    procs = [*burners, holder, *waiters]
    for p in procs:
        p.start()
    try:
        wait_set(held, [holder], "the holder taking the lease")
        lease = lock_path.with_suffix(".lease")
        # Hold for at least four lease times, counted in the holder's own renewals (a
        # renewal every quarter lease): the waiters poll and judge all along.
        renewals, deadline = 0, time.monotonic() + 120  # a bound, not a measurement
        while renewals < 16:
            assert time.monotonic() < deadline, f"only {renewals} renewals"
            raw = lease.read_bytes() if lease.exists() else b"{}"
            try:
                renewals = json.loads(raw or b"{}").get("renewals", 0)
            except ValueError:
                continue  # caught mid-rewrite
            assert holder.is_alive()
        release.set()
        results = collect(out, [holder, *waiters], 4)
    finally:
        stop.set()
        release.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert ("holder", False) in results  # never lost its lease
    assert sorted(r for r in results if r[0] == "waiter") == [("waiter", 0)] * 3  # none broke it
