"""The node-local lock in front of the lease, on a real network file system: two JuiceFS
mounts of one volume stand for two nodes (tools/juicefs.py), each with its own
node-local lock directory and several real processes. Crashes are real SIGKILLs."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from processes import run_together

from shardcache import ShardCache
from shardcache._base.errors import LockTimeout
from shardcache._locking.node_lock import node_lock_path
from shardcache._locking.policy import LockPolicy
from shardcache._locking.shard_lock import ShardLock
from tools.juicefs import Node

CTX = mp.get_context("spawn")
BUCKET = "nodelock"
WAIT = 60.0  # every wait of the tests below is bounded by this
PATIENT = {"timeout": 3600.0, "stuck_after": 3600.0, "lease_time": 3600.0}


def _count_lease_attempts(log: Path) -> None:
    """In a child: log each lease attempt (the lease file it tries) to ``log``."""
    from shardcache._locking import lease

    original = lease.LeaseBackend.try_acquire

    def counted(self: Any) -> bool:
        with log.open("a") as f:
            f.write(f"{os.getpid()} {self.record_path.name}\n")
        return original(self)

    lease.LeaseBackend.try_acquire = counted  # type: ignore[method-assign]


def _racer(node: dict, urls: list[str], seed: int, start, out) -> None:
    _count_lease_attempts(Path(node["attempts"]))
    cache = ShardCache(
        node["cache_dir"], scope="node", node_lock_dir=node["node_lock_dir"], lease_time=30
    )
    order = list(urls)
    random.Random(seed).shuffle(order)
    start.wait()
    digests = {u: hashlib.sha256(cache.fetch(u).read_bytes()).hexdigest() for u in order}
    out.put((node["name"], os.getpid(), digests, cache.stats().as_dict()))


def test_two_nodes_download_each_shard_once_and_one_process_per_node_takes_the_lease(
    s3, jfs_nodes: list[Node], tmp_path: Path
) -> None:
    per_node, n = 3, 8
    rng = random.Random("nodes")
    blobs = {f"n-{i:03d}.tar": rng.randbytes(rng.randrange(50_000, 300_000)) for i in range(n)}
    s3.put_objects(BUCKET, blobs)
    urls = {f"s3://{BUCKET}/{k}": hashlib.sha256(v).hexdigest() for k, v in blobs.items()}
    nodes = [
        {
            "name": node.name,
            "cache_dir": str(node.root / "cache"),  # one directory of the volume, two mounts
            "node_lock_dir": str(node.node_lock_dir),
            "attempts": str(tmp_path / f"attempts-{node.name}"),
        }
        for node in jfs_nodes
    ]
    args = [(node, list(urls), 10 * i + j) for i, node in enumerate(nodes) for j in range(per_node)]
    results = run_together(_racer, args)
    assert all(digests == urls for _, _, digests, _ in results), "every byte right"
    assert sum(s["misses"] for *_, s in results) == n
    assert {k: s3.count("GET", BUCKET, k) for k in blobs} == dict.fromkeys(blobs, 1)
    for node in nodes:
        takers: dict[str, set[str]] = {}
        for line in Path(node["attempts"]).read_text().splitlines():
            pid, lease = line.split()
            takers.setdefault(lease, set()).add(pid)
        # The node lock's holder alone tries the lease; its local waiters find the shard
        # published when they get the node lock, and never touch the lease files.
        assert all(len(pids) == 1 for pids in takers.values()), (node["name"], takers)
    leftovers = [
        p for p in (jfs_nodes[0].root / "cache").rglob("*") if p.suffix in {".lease", ".claim"}
    ]
    assert not leftovers


# ------------------------------------------------------------ ShardLock level, two nodes


def _lock(node: dict, *, url: str = "s3://b/k", **policy: float) -> ShardLock:
    lock_path = Path(node["locks"]) / "ab" / "x.lock"
    return ShardLock(
        lock_path,
        url=url,
        policy=LockPolicy(mode="lease", **{**PATIENT, **policy}),
        node_lock=node_lock_path(Path(node["node_lock_dir"]), lock_path),
    )


def _report(path: str, **fields: Any) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


def _reports(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except FileNotFoundError:
        return []


def _until(what: str, check: Any, procs: list[Any]) -> None:
    """Wait (bounded) until ``check()``; fail early if a process died."""
    deadline = time.monotonic() + WAIT
    while not check():
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        assert not dead and time.monotonic() < deadline, f"never: {what} (exit codes {dead})"
        time.sleep(0.02)  # polling a condition, bounded by the deadline


def _hold_until(node: dict, report: str, go: str, **policy: float) -> None:
    """Take the lock and hold it until ``go`` exists, moving the bytes on meanwhile."""
    lock = _lock(node, **policy)
    assert lock.acquire()
    _report(report, event="held", pid=os.getpid())
    done, deadline = 0, time.monotonic() + WAIT
    while not os.path.exists(go) and time.monotonic() < deadline:
        done += 1000
        lock.heartbeat(phase="download", bytes_done=done, bytes_total=10**9)
        time.sleep(0.05)  # a download's pace, not synchronisation
    Path(node["published"]).write_bytes(b"x")
    lock.release()


def _wait_for(node: dict, report: str, **policy: float) -> None:
    """Wait for the lock until the shard is published; report what was seen."""
    published = Path(node["published"])

    def seen(record: dict[str, Any] | None) -> None:
        record = record or {}
        _report(report, event="saw", phase=record.get("phase"), bytes=record.get("bytes_done"))

    lock = _lock(node, **policy)
    lock.on_wait = seen
    if lock.node_lock is not None:
        lock.node_lock.on_wait = seen
    try:
        held = lock.acquire(done=published.exists)
    except LockTimeout as exc:
        _report(report, event="timeout", error=str(exc))
        return
    if held:
        lock.release()
    _report(report, event="held" if held else "done")


def _node_dicts(jfs_nodes: list[Node], tmp_path: Path) -> list[dict[str, str]]:
    return [
        {
            "locks": str(node.root / "locks"),
            "node_lock_dir": str(node.node_lock_dir),
            "published": str(node.root / "published"),
        }
        for node in jfs_nodes
    ]


def test_local_waiters_follow_the_remote_holders_progress(
    jfs_nodes: list[Node], tmp_path: Path
) -> None:
    """Node B downloads; on node A the node lock's holder waits for B's lease and a local
    waiter waits on the node lock. Both give up on a holder stuck for 20 s, and B's download
    lasts twice as long: the local waiter sees B's progress through its local holder's
    record. (20 s, not less: a change travels B's record, A's JuiceFS mount, the holder's
    poll, its node-lock record and the waiter's poll, each paced, on 2 loaded cores; 4 s,
    8 s and then 15 s each timed out once in CI, beside the other pytest worker's tests.)"""
    a, b = _node_dicts(jfs_nodes, tmp_path)
    go = str(tmp_path / "go")
    reports = {name: tmp_path / f"{name}.jsonl" for name in ("b", "holder", "waiter")}
    quick = {"stuck_after": 20.0, "lease_time": 2.0}
    procs = [CTX.Process(target=_hold_until, args=(b, str(reports["b"]), go), kwargs=quick)]
    try:
        procs[0].start()
        _until("B holds the lease", lambda: _reports(reports["b"]), procs)
        for name in ("holder", "waiter"):
            procs.append(CTX.Process(target=_wait_for, args=(a, str(reports[name])), kwargs=quick))
            procs[-1].start()
            _until(f"{name} waits", lambda name=name: _reports(reports[name]), procs)

        waiting_since = time.monotonic()

        def waiter_saw_b_progress_for_long() -> bool:
            seen = [r["bytes"] or 0 for r in _reports(reports["waiter"]) if r["event"] == "saw"]
            long = time.monotonic() - waiting_since >= 2 * quick["stuck_after"]
            return len(set(seen)) >= 2 and long

        # Twice the 20 s after which a waiter that saw no progress gives up (a timeout is
        # reported, and fails the test below).
        _until("the local waiter sees 40 s of B's progress", waiter_saw_b_progress_for_long, procs)
        Path(go).touch()
        for p in procs:
            p.join(WAIT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    waiter, holder = _reports(reports["waiter"]), _reports(reports["holder"])
    # The waiter returns once the shard is published (B's done-marker); the node lock's
    # holder may take the lease B released first (fetch then finds the shard published).
    assert not [r for r in waiter + holder if r["event"] == "timeout"], (waiter, holder)
    assert waiter[-1]["event"] == "done" and holder[-1]["event"] in {"held", "done"}, holder
    phases = {r["phase"] for r in waiter if r["event"] == "saw"}
    b_pid = _reports(reports["b"])[0]["pid"]
    assert any(f"waiting for the lease of pid {b_pid}" in (p or "") for p in phases), phases


def test_a_sigkilled_node_lock_holder_lets_the_next_local_process_take_over(
    jfs_nodes: list[Node], tmp_path: Path
) -> None:
    a, _ = _node_dicts(jfs_nodes, tmp_path)
    reports = {name: tmp_path / f"{name}.jsonl" for name in ("first", "next")}
    never = str(tmp_path / "never")  # the first holder holds until it is killed
    procs = [CTX.Process(target=_hold_until, args=(a, str(reports["first"]), never))]
    try:
        procs[0].start()
        _until("the first process holds", lambda: _reports(reports["first"]), procs)
        procs.append(CTX.Process(target=_wait_for, args=(a, str(reports["next"]))))
        procs[1].start()
        # Waiting on the node lock: it has seen the first holder's record there.
        _until("the next process waits", lambda: _reports(reports["next"]), procs)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(WAIT)
        procs[1].join(WAIT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert procs[0].exitcode == -signal.SIGKILL and procs[1].exitcode == 0
    # Lock timeout, stuck time and lease time are an hour: the kernel freed the node lock
    # and the dead holder's lease (same host, pid gone) was broken at once.
    assert _reports(reports["next"])[-1]["event"] == "held", _reports(reports["next"])


@pytest.mark.parametrize("node_lock_dir", ["default", "off"])
def test_auto_mode_on_juicefs_takes_the_node_lock_unless_off(
    jfs_nodes: list[Node], tmp_path: Path, node_lock_dir: str
) -> None:
    src = tmp_path / "src.tar"
    src.write_bytes(b"s" * 10_000)
    setting = None if node_lock_dir == "default" else "off"
    cache = ShardCache(jfs_nodes[0].root / "cache", node_lock_dir=setting)
    assert cache._locks.policy().mode == "lease"
    assert cache.fetch(str(src)).read_bytes() == b"s" * 10_000
    assert (cache._locks.node_fs() is None) == (setting == "off")
