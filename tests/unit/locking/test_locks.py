"""The stale-lock-aware shard lock, with real processes, threads and SIGKILL."""

from __future__ import annotations

import dataclasses
import errno
import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from processes import TOGETHER_TIMEOUT, wait_set

from shardcache._base.errors import LockTimeout
from shardcache._base.process_identity import ProcessIdentity
from shardcache._locking.policy import LockPolicy
from shardcache._locking.shard_lock import ShardLock

MODES = ["flock", "lease"]
CTX = mp.get_context("spawn")


def _policy(mode: str, **kw: float) -> LockPolicy:
    return LockPolicy(mode=mode, **{"timeout": 60.0, "stuck_after": 60.0, "lease_time": 60.0, **kw})


def _critical_sections(lock_path: str, log_path: str, mode: str, rounds: int) -> None:
    """Enter the lock ``rounds`` times, logging enter/exit with O_APPEND (atomic writes)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    me = f"{os.getpid()}-{threading.get_ident()}"
    for _ in range(rounds):
        lock = ShardLock(Path(lock_path), url="s3://b/k", policy=_policy(mode))
        with lock.hold() as held:
            assert held
            os.write(fd, f"enter {me}\n".encode())
            os.write(fd, f"exit {me}\n".encode())
    os.close(fd)


def _assert_no_overlap(log_path: Path, expected: int) -> None:
    lines = log_path.read_text().splitlines()
    assert len(lines) == 2 * expected
    for enter, leave in zip(lines[::2], lines[1::2], strict=True):
        assert enter.startswith("enter ") and leave.startswith("exit ")
        assert enter.split()[1] == leave.split()[1], "two holders at once"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.timeout(TOGETHER_TIMEOUT)
def test_processes_exclude_each_other(tmp_path: Path, mode: str) -> None:
    lock_path, log = tmp_path / ".locks" / "ab" / "x.lock", tmp_path / "log"
    procs = [
        CTX.Process(target=_critical_sections, args=(str(lock_path), str(log), mode, 15))
        for _ in range(8)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:  # no 60 s bound: beside load 8 spawned processes took longer
            p.join()
    finally:
        for p in procs:
            p.kill()
    assert [p.exitcode for p in procs] == [0] * 8
    _assert_no_overlap(log, 8 * 15)


@pytest.mark.parametrize("mode", MODES)
def test_threads_exclude_each_other(tmp_path: Path, mode: str) -> None:
    lock_path, log = tmp_path / "x.lock", tmp_path / "log"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _critical_sections(str(lock_path), str(log), mode, 20)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    _assert_no_overlap(log, 8 * 20)


def _hold_forever(lock_path: str, mode: str, ready: mp.Event, progress: bool) -> None:
    # Lease: the smallest accepted lease time, renewed every quarter of it (the waiters of
    # these tests judge with the same lease time).
    lock = ShardLock(Path(lock_path), url="s3://b/held", policy=_policy(mode, lease_time=1.0))
    assert lock.acquire()
    lock.heartbeat(phase="downloading", bytes_done=1, bytes_total=100)
    ready.set()
    n = 1
    while True:  # the parent kills us
        if progress:
            n += 1
            lock.heartbeat(phase="downloading", bytes_done=n, bytes_total=10**9)
        threading.Event().wait(0.05)


def _start_holder(lock_path: Path, mode: str, progress: bool = False) -> mp.Process:
    ready = CTX.Event()
    holder = CTX.Process(target=_hold_forever, args=(str(lock_path), mode, ready, progress))
    holder.start()
    wait_set(ready, [holder], "the holder taking the lock")
    return holder


@pytest.mark.parametrize("mode", MODES)
def test_sigkilled_holder_is_recovered_without_waiting_for_timeout(
    tmp_path: Path, mode: str
) -> None:
    lock_path = tmp_path / "x.lock"
    holder = _start_holder(lock_path, mode)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    # The holder's record would only expire after an hour, and the wait gives up with
    # LockTimeout after a minute: getting the lock at all proves the recovery came from the
    # kernel (flock) or from the proof that the holder's pid is dead (lease), at the first
    # look (flock) or the one after the dead lease was broken (lease).
    policy = _policy(mode, timeout=60.0, stuck_after=3600.0, lease_time=3600.0)
    lock = ShardLock(lock_path, url="s3://b/held", policy=policy)
    with lock.hold() as held:
        assert held
        record_path = lock.lease_path if mode == "lease" else lock.owner_path
        attempts = json.loads(record_path.read_text())["attempts"]
    assert attempts == (2 if mode == "lease" else 1), attempts


def _write_lease(path: Path, **fields: object) -> None:
    me = ProcessIdentity.current()
    record = {
        "host": me.host,
        "boot_id": me.boot_id,
        "pidns": me.pidns,
        "pid": me.pid,
        "start_ticks": me.start_ticks,
        "since": time.time(),
        "phase": "downloading",
        **fields,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def test_lease_of_dead_local_pid_is_broken_at_once(tmp_path: Path) -> None:
    lock_path = tmp_path / "x.lock"
    dead = CTX.Process(target=os.getpid)
    dead.start()
    dead.join(30)
    _write_lease(lock_path.with_suffix(".lease"), pid=dead.pid, start_ticks=12345)
    lock = ShardLock(lock_path, url="s3://b/k", policy=_policy("lease"))
    with lock.hold() as held:
        assert held
        record = json.loads(lock.lease_path.read_text())
        assert record["pid"] == os.getpid()


def test_lease_of_silent_remote_host_expires(tmp_path: Path) -> None:
    lock_path = tmp_path / "x.lock"
    _write_lease(lock_path.with_suffix(".lease"), host="node-elsewhere", pid=1)
    lock = ShardLock(lock_path, url="s3://b/k", policy=_policy("lease", lease_time=0.3))
    with lock.hold() as held:
        assert held


def test_live_lease_holder_is_not_broken(tmp_path: Path) -> None:
    lock_path = tmp_path / "x.lock"
    holder = _start_holder(lock_path, "lease", progress=True)
    try:
        lock = ShardLock(
            lock_path, url="s3://b/held", policy=_policy("lease", lease_time=1.0, timeout=3.0)
        )
        with pytest.raises(LockTimeout) as info:
            lock.acquire()
        assert info.value.verdict == "alive"
        assert holder.is_alive()
    finally:
        holder.kill()
        holder.join(10)


def test_stuck_flock_holder_gives_a_diagnostic_timeout(tmp_path: Path) -> None:
    lock_path = tmp_path / "x.lock"
    holder = _start_holder(lock_path, "flock", progress=False)
    try:
        lock = ShardLock(lock_path, url="s3://b/held", policy=_policy("flock", stuck_after=0.5))
        with pytest.raises(LockTimeout) as info:
            lock.acquire()
    finally:
        holder.kill()
        holder.join(10)
    exc = info.value
    message = str(exc)
    for expected in (
        "s3://b/held",
        str(lock_path),
        f"pid {holder.pid}",
        "verdict: alive",
        "has not changed",
        "what to do",
        "py-spy dump",
    ):
        assert expected in message
    assert exc.owner["pid"] == holder.pid
    clone = pickle.loads(pickle.dumps(exc))
    assert type(clone) is LockTimeout and str(clone) == message and clone.url == exc.url


def test_waiter_stops_when_the_work_is_done(tmp_path: Path) -> None:
    lock_path = tmp_path / "x.lock"
    holder = _start_holder(lock_path, "flock")
    try:
        finished = threading.Event()
        threading.Timer(0.2, finished.set).start()
        lock = ShardLock(lock_path, url="s3://b/held", policy=_policy("flock"))
        assert lock.acquire(done=finished.is_set) is False
    finally:
        holder.kill()
        holder.join(10)


@pytest.mark.parametrize("mode", MODES)
def test_vanished_lock_directory_is_survived(tmp_path: Path, mode: str) -> None:
    locks = tmp_path / ".locks"
    lock_path = locks / "ab" / "x.lock"
    with ShardLock(lock_path, url="s3://b/k", policy=_policy(mode)).hold() as held:
        assert held
    shutil.rmtree(locks)  # e.g. a user cleaning the cache under a running job
    with ShardLock(lock_path, url="s3://b/k", policy=_policy(mode)).hold() as held:
        assert held
    assert lock_path.exists() if mode == "flock" else not lock_path.with_suffix(".lease").exists()


def test_flock_lock_file_is_never_deleted(tmp_path: Path) -> None:
    lock_path = tmp_path / "x.lock"
    with ShardLock(lock_path, url="s3://b/k", policy=_policy("flock")).hold():
        inode = lock_path.stat().st_ino
    assert lock_path.stat().st_ino == inode


def test_garbage_lease_record_is_treated_as_unknown_and_expires(tmp_path: Path) -> None:
    lock_path = tmp_path / "x.lock"
    lock_path.with_suffix(".lease").write_bytes(b"\x00garbage{")
    lock = ShardLock(lock_path, url="s3://b/k", policy=_policy("lease", lease_time=0.2))
    with lock.hold() as held:
        assert held


def test_waiter_sees_the_holders_progress(tmp_path: Path) -> None:
    lock_path = tmp_path / "x.lock"
    holder = _start_holder(lock_path, "flock", progress=True)
    seen: list[int] = []
    try:
        enough = threading.Event()

        def on_wait(record: dict | None) -> None:
            if record is not None:
                seen.append(record["bytes_done"])
                if len(set(seen)) >= 3:
                    enough.set()

        lock = ShardLock(lock_path, url="s3://b/held", policy=_policy("flock"), on_wait=on_wait)
        assert lock.acquire(done=enough.is_set) is False
    finally:
        holder.kill()
        holder.join(10)
    assert len(set(seen)) >= 3 and seen == sorted(seen)


def test_a_waiter_reports_at_its_first_wait_before_the_holder_has_a_record(
    tmp_path: Path,
) -> None:
    import fcntl

    lock_path = tmp_path / "held.lock"
    holder = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # held, and no record written: a holder just starting
    seen: list[dict | None] = []
    try:
        lock = ShardLock(
            lock_path, url="s3://b/held", policy=_policy("flock", timeout=3.0), on_wait=seen.append
        )
        assert lock.acquire(done=lambda: bool(seen)) is False
    finally:
        os.close(holder)
    assert seen == [None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RarePolls(LockPolicy):
    """A waiter that would look again only 15-45 s after a failed attempt."""

    @property
    def backoff(self) -> tuple[float, float]:
        return 30.0, 30.0


def _hold_until_released(lock_path: str, ready: mp.Event, release: mp.Event) -> None:
    lock = ShardLock(Path(lock_path), url="s3://b/held", policy=_policy("flock"))
    assert lock.acquire()
    ready.set()
    assert release.wait(60)
    lock.release()


def _released_while_waiting(lock_path: Path, policy: LockPolicy, join: float) -> list[bool]:
    """Another process holds ``lock_path``; a thread here waits for it with ``policy``, and
    once it has found the lock held the holder lets go. What the wait returned within
    ``join`` seconds of that (empty: still waiting)."""
    ready, release = CTX.Event(), CTX.Event()
    holder = CTX.Process(target=_hold_until_released, args=(str(lock_path), ready, release))
    holder.start()
    waiting = threading.Event()
    lock = ShardLock(
        lock_path, url="s3://b/held", policy=policy, on_wait=lambda _record: waiting.set()
    )
    result: list[bool] = []
    try:
        wait_set(ready, [holder], "the holder taking the lock")
        waiter = threading.Thread(target=lambda: result.append(lock.acquire()), daemon=True)
        waiter.start()
        assert waiting.wait(30), "the waiter never found the lock held"
        release.set()
        waiter.join(join)
        return list(result)
    finally:
        release.set()
        holder.join(30)
        assert holder.exitcode == 0
        lock.release()


def test_a_flock_waiter_wakes_when_the_holder_lets_go_not_at_its_next_poll(
    tmp_path: Path,
) -> None:
    # Its next poll is at least 15 s away: only the holder's release can wake it sooner.
    policy = _RarePolls(mode="flock", timeout=120.0, stuck_after=120.0)
    assert _released_while_waiting(tmp_path / "x.lock", policy, join=10) == [True]


def test_a_waiter_that_cannot_watch_the_lock_polls_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from shardcache._locking.flock import FlockBackend

    def no_watch(self: FlockBackend) -> None:
        raise OSError(errno.ENOLCK, "no locks available", str(self.path))

    monkeypatch.setattr(FlockBackend, "watch_release", no_watch)
    lock_path = tmp_path / "x.lock"
    with caplog.at_level("DEBUG", logger="shardcache"):
        assert _released_while_waiting(lock_path, _policy("flock"), join=30) == [True]
    assert f"cannot watch {lock_path} for its release" in caplog.text


@pytest.mark.parametrize("mode", MODES)
def test_a_symlinked_lock_file_is_refused_without_touching_its_target(
    tmp_path: Path, mode: str
) -> None:
    from shardcache._base.errors import CacheError

    lock_path = tmp_path / "cache" / "x.lock"
    lock_path.parent.mkdir()
    outside = tmp_path / "outside"
    target = lock_path if mode == "flock" else lock_path.with_suffix(".lease")
    target.symlink_to(outside)
    lock = ShardLock(lock_path, url="s3://b/k", policy=_policy(mode, lease_time=0.2, timeout=2))
    if mode == "flock":
        with pytest.raises(CacheError, match="symbolic link"):
            lock.acquire()
    else:  # a lease path that is a link is judged like any unreadable record, then broken
        with lock.hold() as held:
            assert held
    assert not outside.exists()
