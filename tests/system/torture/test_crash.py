"""SIGKILL a fetching process at chosen and random instants, then check the cache.

The child fetches from an S3 server (moto, and SeaweedFS) through a :class:`FaultProxy`
(one GET stream, or parallel 64 KB ranged GETs) or from a local file, in flock and lease
lock modes, and
is killed at a named instant, at a random byte offset of its download, or after a random
delay. After every kill:

1. nothing partial or corrupt is at a final name: every published shard has metadata and
   the sha256 of its source, and the shard is published exactly when the kill came after
   the rename;
2. the next fetch (this process, lock timeout and lease time set to a day) succeeds at
   once: one lock attempt (flock: the kernel freed the dead child's lock; lease: two, the
   dead child's lease is broken at the first look), one miss in the cache's counters, and
   exactly the expected GETs at the proxy (one per part, no HEAD); a shard published before
   the kill is a hit with no request at all;
3. ``shardcache clean`` removes every leftover (the dead child's ``.part``, lease, claim),
   and ``status`` then reports nothing stale.

The proxy is restarted on the same port between the kill and the next fetch: stopping it
joins every connection thread of the dead child, so the requests counted by the new one
are the next fetch's alone.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import crash_child
import pytest
from crash_child import INSTANTS, PATHS
from torture_scale import scale

from shardcache import ShardCache
from shardcache._cache.shard_cache import CacheStats
from shardcache._cli import main as cli
from shardcache._disk.layout import is_temp_name
from shardcache._locking.records import holder_verdict, read_owner, read_record
from shardcache._ops import maintenance
from shardcache.testing import FaultProxy, S3Server

# Children are forked from a server that imported shardcache and s3fs once (crash_child
# itself is not importable there: the fork server does not get the test's sys.path).
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["shardcache", "s3fs"])
# One cycle of instants; the random byte offsets and random delays get twice the share.
CYCLE = (
    "locked",
    "download",
    "verify",
    "meta",
    "rename",
    "renamed",
    "random",
    "download",
    "random",
)
CYCLES = scale(1, 7)  # per lock mode and path: 9 kills in CI, 63 in the full run
BUCKET = "crash-src"
LINE_TIMEOUT = 60.0  # a child that has not reached its instant by then is a failure
A_DAY = 86400.0  # lock_timeout and lease_time: the next fetch must never wait for them
CHILD_RATE = 4e6  # bytes/s per connection the children get: random kills land mid-download
PATH_LABELS = {
    "single": "S3 through the proxy, one GET stream",
    "parts": "S3 through the proxy, 64 KB ranged GETs x4 in flight",
    "local": "a local file",
}
# The S3 paths again on SeaweedFS (the fixture of that name; "s3" is moto).
SEAWEEDFS_PATHS = [("single", "seaweedfs"), ("parts", "seaweedfs")]
SERVER_LABELS = {"s3": "", "seaweedfs": " (SeaweedFS)", None: ""}
assert set(CYCLE) == set(INSTANTS)


@dataclass(frozen=True)
class Kill:
    """One kill: where the child was, and for ``random`` where that turned out to be."""

    instant: str
    elapsed: float | None  # seconds from the start of the fetch to the instant
    thread: str | None  # the thread that reached the instant


class _Link:
    """The S3 endpoint both processes use: a fault proxy on one fixed port."""

    def __init__(self, s3: S3Server) -> None:
        self.s3 = s3
        with FaultProxy("127.0.0.1", s3.port) as probe:
            self.port = probe.port
        self.endpoint_url = f"http://127.0.0.1:{self.port}"

    @contextlib.contextmanager
    def serving(self, **shaping: float) -> Iterator[FaultProxy]:
        with FaultProxy("127.0.0.1", self.s3.port, port=self.port, **shaping) as proxy:
            yield proxy


def _receive(proc: BaseProcess, pipe: Connection, timeout: float) -> str:
    """The child's next message, bounded by ``timeout``; fails at once if the child died."""
    ready = mp_wait([pipe, proc.sentinel], timeout)
    if pipe in ready:
        return str(pipe.recv())
    proc.join(0)
    raise AssertionError(f"child {proc.pid} said nothing (exit code {proc.exitcode})")


def _run_and_kill(
    argv: list[str], env: dict[str, str], instant: str, delay: float
) -> tuple[Kill, int]:
    """Start the child, let it reach ``instant`` (``random``: ``delay`` s after GO), SIGKILL it.

    Returns where it was and its pid. The child is reaped before this returns.
    """
    pipe, child_end = CTX.Pipe()
    proc = CTX.Process(target=crash_child.run, args=(argv, env, child_end), daemon=True)
    proc.start()
    child_end.close()
    try:
        line = _receive(proc, pipe, LINE_TIMEOUT)
        if instant == "random":
            assert line == "GO", line
            proc.join(delay)  # the child never exits by itself: a bounded pause
            kill = Kill(instant, None, None)
        else:
            word, at, elapsed, thread = line.split(" ", 3)
            assert (word, at) == ("AT", instant), line
            kill = Kill(instant, float(elapsed), thread)
    finally:
        proc.kill()
        proc.join(30)
        pipe.close()
    assert proc.exitcode == -signal.SIGKILL, f"child exited with {proc.exitcode}"
    assert proc.pid is not None
    return kill, proc.pid


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _leftovers(scope: Path) -> list[Path]:
    """Files that are neither a published shard, its metadata, nor a lock/owner file."""
    out = []
    for p in scope.rglob("*"):
        if not p.is_file():
            continue
        if p.parent.parent.name == "data" and not is_temp_name(p.name):
            continue
        if (
            p.parent.parent.name == ".meta"
            and p.name.endswith(".json")
            and not p.name.startswith(".")
        ):
            continue
        if p.suffix in (".lock", ".owner"):
            continue
        out.append(p)
    return out


def _known_gaps(left: list[Path], pid: int) -> dict[str, list[Path]]:
    """Leftovers of the dead child ``pid`` that clean judges by age only (known gaps).

    A kill between creating a lease claim and writing its record leaves an empty claim
    (no pid to judge; kept until OTHER_HOST_AGE); a kill mid metadata write leaves
    ``.<name>.json.<pid>.<ns>.tmp`` (kept until META_TMP_AGE although the pid is dead).
    """
    gaps: dict[str, list[Path]] = {}
    for p in left:
        if p.suffix == ".claim" and p.stat().st_size == 0:
            gaps.setdefault("empty claim", []).append(p)
        elif re.fullmatch(rf"\..+\.json\.{pid}\.[0-9]+\.tmp", p.name):
            gaps.setdefault("metadata temp", []).append(p)
    return gaps


def _clean(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``shardcache clean --json`` on the cache; its report."""
    capsys.readouterr()
    rc = cli.main(["clean", "--json", "--cache-dir", str(cache_dir), "--scope", "node"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


@dataclass
class _Tally:
    """What the kills of one test did, for the figures."""

    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    random_landed: collections.Counter[str] = field(default_factory=collections.Counter)
    recovery: collections.Counter[str] = field(default_factory=collections.Counter)
    cleaned: collections.Counter[str] = field(default_factory=collections.Counter)
    requests: int = 0


@dataclass
class _NextFetch:
    """The fetch after a kill, and what it counted."""

    path: Path
    before: CacheStats
    after: CacheStats
    held: dict[str, Any]  # our lock record, read while we held the lock (empty on a hit)
    requests: int | None  # requests the proxy saw (None: local source)

    def delta(self, name: str) -> float:
        return float(getattr(self.after, name) - getattr(self.before, name))


def _fetch_next(
    cache: ShardCache, url: str, lock_path: Path, lock_mode: str, link: _Link | None
) -> _NextFetch:
    """Fetch ``url`` in this process, through a fresh proxy."""
    held: dict[str, Any] = {}

    def progress(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        if phase == "requesting" and not held:  # we hold the lock and our record is written
            if lock_mode == "lease":
                record = read_record(cache.layout.fs, lock_path.with_suffix(".lease"))[1]
            else:
                record = read_owner(cache.layout.fs, lock_path)
            held.update(record or {})

    before = cache.stats()
    with link.serving() if link else contextlib.nullcontext() as proxy:
        path = cache.fetch(url, progress=progress)
        requests = proxy.stats().requests if proxy else None
    return _NextFetch(path, before, cache.stats(), held, requests)


def _sources(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    path: str,
    server: str | None,
    blobs: dict[str, bytes],
) -> tuple[dict[str, bytes], _Link | None]:
    """The shards as URLs of ``path``'s kind on ``server`` (an S3 fixture's name), and the
    S3 link (None for local files)."""
    if path == "local":
        src = tmp_path / "src"
        src.mkdir()
        for name, data in blobs.items():
            (src / name).write_bytes(data)
        return {f"file://{src / name}": data for name, data in blobs.items()}, None
    assert server is not None
    s3: S3Server = request.getfixturevalue(server)
    s3.put_objects(BUCKET, blobs)
    return {f"s3://{BUCKET}/{name}": data for name, data in blobs.items()}, _Link(s3)


class _Torture:
    """One lock mode and download path: the kills and the checks after each."""

    def __init__(
        self,
        cache: ShardCache,
        sources: dict[str, bytes],
        link: _Link | None,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        self.cache = cache
        self.sources = sources
        self.digests = {url: _sha(data) for url, data in sources.items()}
        self.link = link
        self.capsys = capsys
        self.lock_mode = cache.settings.lock_mode
        self.part_size = cache.settings.part_size if cache.settings.parallel_parts > 1 else None
        self.tally = _Tally()

    def check_published(self, url: str, kill: Kill, where: str) -> tuple[bool, bool]:
        """1. Nothing partial or corrupt at a final name; published exactly after the rename.

        Returns whether ``url`` is published and whether a ``.part`` was left beside it.
        """
        for entry in self.cache.entries():
            assert entry.url in self.digests, f"{where}: no metadata: {entry.path}"
            assert _sha(entry.path.read_bytes()) == self.digests[entry.url], f"{where}: corrupt"
        published = self.cache.contains(url)
        final = self.cache.path_for(url)
        part_left = any(is_temp_name(p.name) for p in final.parent.iterdir())
        if kill.instant == "random":
            landed = "published" if published else "mid-fetch" if part_left else "before"
            self.tally.random_landed[landed] += 1
        else:
            assert published == (kill.instant == "renamed"), where
            assert part_left == (kill.instant in ("download", "verify", "meta", "rename")), where
        return published, part_left

    def check_next_fetch(self, url: str, published: bool, where: str) -> bool:
        """2. The next fetch succeeds at once: lock attempts, cache counters, requests.

        Returns whether the dead child left its lease.
        """
        cache = self.cache
        lock_path = cache._identify(url).lock_path
        lease_raw, lease = read_record(cache.layout.fs, lock_path.with_suffix(".lease"))
        if lease_raw is not None:  # the dead child's lease: judged dead, so broken at once
            assert holder_verdict(lease)[0] == "dead", (where, lease_raw, holder_verdict(lease))
        nxt = _fetch_next(cache, url, lock_path, self.lock_mode, self.link)
        assert _sha(nxt.path.read_bytes()) == self.digests[url], where
        assert nxt.delta("errors") == nxt.delta("shared") == 0, where
        if published:
            assert (nxt.delta("hits"), nxt.delta("misses")) == (1, 0), where
            assert nxt.requests in (0, None), (where, nxt.requests)
            self.tally.recovery["hit, no request"] += 1
            return lease_raw is not None
        size = len(self.sources[url])
        assert (nxt.delta("hits"), nxt.delta("misses")) == (0, 1), where
        assert nxt.delta("bytes_downloaded") == size, where
        assert nxt.held.get("pid") == os.getpid(), (where, nxt.held)
        attempts = 2 if lease_raw is not None else 1
        assert nxt.held.get("attempts") == attempts, (where, nxt.held)
        self.tally.recovery[f"miss, {attempts} lock attempt{'s' * (attempts > 1)}"] += 1
        if nxt.requests is not None:
            gets = -(-size // self.part_size) if self.part_size else 1
            assert nxt.requests == gets, f"{where}: {nxt.requests} requests, not {gets}"
            self.tally.requests += nxt.requests
        return lease_raw is not None

    def check_part_removed(self, pid: int, part_left: bool, where: str) -> None:
        """2b. The dead child's ``.part`` is gone once the next fetch ran: a miss into its
        directory removes it under the shard's lock (or the bounded cache's next count)."""
        parts = [
            p
            for p in _leftovers(self.cache.settings.scope_dir)
            if is_temp_name(p.name) and f".{pid}." in p.name
        ]
        assert not parts, (where, parts)
        if part_left:
            self.tally.cleaned["part removed by the next fetch"] += 1

    def check_clean(self, pid: int, stale_lease: bool, where: str) -> None:
        """3. ``shardcache clean`` removes every leftover of the dead child (its ``.part``
        is already gone: 2b)."""
        report = _clean(self.cache.settings.cache_dir, self.capsys)
        assert not report["failed"] and not report["kept"], (where, report)
        kinds = collections.Counter(item["kind"] for item in report["removed"])
        self.tally.cleaned.update(kinds)
        assert kinds["part"] == 0, (where, report)
        assert kinds["lease"] == stale_lease, (where, report)
        left = _leftovers(self.cache.settings.scope_dir)
        gaps = _known_gaps(left, pid)
        for kind, paths in gaps.items():  # counted and reported, then removed by hand
            self.tally.cleaned[f"{kind} kept by clean (known gap)"] += len(paths)
            for p in paths:
                p.unlink()
        assert sorted(left) == sorted(p for paths in gaps.values() for p in paths), (where, left)
        status = maintenance.status(self.cache)
        assert not status.stale_locks and not status.orphans, status.format()


@pytest.mark.timeout(scale(300, 1800))
@pytest.mark.parametrize(
    ("path", "server"),
    [("single", "s3"), ("parts", "s3"), ("local", None), *SEAWEEDFS_PATHS],
    ids=["single", "parts", "local", "single-seaweedfs", "parts-seaweedfs"],
)
@pytest.mark.parametrize("lock_mode", ["flock", "lease"])
def test_sigkill_fetch(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    lock_mode: str,
    path: str,
    server: str | None,
    figures: Any,
) -> None:
    rng = random.Random(f"crash-{lock_mode}-{path}")
    blobs = {f"train-{i:06d}.tar": rng.randbytes(rng.randrange(150_000, 400_000)) for i in range(6)}
    sources, link = _sources(request, tmp_path, path, server, blobs)
    env = dict(os.environ)
    if link is not None:  # both processes reach S3 through the proxy's port
        env.update(link.s3.env(link.endpoint_url))
        for name, value in link.s3.env(link.endpoint_url).items():
            monkeypatch.setenv(name, value)
    cache_dir = tmp_path / "cache"
    cache = ShardCache(
        cache_dir,
        # A connection per request: none is pooled across the proxy's restarts.
        storage_options={
            "config_kwargs": {"connector_args": {"force_close": True, "keepalive_timeout": None}}
        },
        lock_mode=lock_mode,
        lock_timeout=A_DAY,
        lock_stuck_after=A_DAY,
        lease_time=A_DAY,
        **PATHS[path],
    )
    torture = _Torture(cache, sources, link, capsys)
    fetches: list[float] = []  # seconds to the rename, from "renamed" kills
    for it in range(CYCLES * len(CYCLE)):
        url = rng.choice(sorted(sources))
        if cache.contains(url):
            assert cache.remove(cache.path_for(url))
        instant = CYCLE[it % len(CYCLE)]
        argv = [str(cache_dir), url, lock_mode, path, instant]
        argv.append(str(rng.randrange(1, len(sources[url]))))  # bytes received, for download
        # For random: a delay within 1.2 x the median fetch time (to the rename) so far.
        delay = rng.uniform(0.0, 1.2 * (statistics.median(fetches) if fetches else 0.2))
        with link.serving(conn_rate=CHILD_RATE) if link else contextlib.nullcontext():
            kill, pid = _run_and_kill(argv, env, instant, delay)
        # (Leaving the proxy joined every one of its threads serving the dead child.)
        where = f"iteration {it} ({instant}, pid {pid})"
        torture.tally.kills[instant] += 1
        if instant == "download":
            receiver = "shardcache-part" if path == "parts" else "MainThread"
            assert kill.thread is not None and kill.thread.startswith(receiver), (where, kill)
        if instant == "renamed" and kill.elapsed is not None:
            fetches.append(kill.elapsed)
        published, part_left = torture.check_published(url, kill, where)
        stale_lease = torture.check_next_fetch(url, published, where) and published
        torture.check_part_removed(pid, part_left, where)
        torture.check_clean(pid, stale_lease, where)

    with link.serving() if link else contextlib.nullcontext():
        for url, digest in torture.digests.items():  # every source is intact and fetchable
            assert _sha(cache.fetch(url).read_bytes()) == digest
    assert set(torture.tally.kills) == set(INSTANTS)
    _report(figures, torture.tally, path, lock_mode, server)


def _report(figures: Any, tally: _Tally, path: str, lock_mode: str, server: str | None) -> None:
    landed = ", ".join(f"{k} {v}" for k, v in sorted(tally.random_landed.items()))
    recovery = ", ".join(f"{k} x{v}" for k, v in sorted(tally.recovery.items()))
    if tally.requests:
        recovery += f"; {tally.requests} requests, exactly the GETs each (no HEAD)"
    cleaned = ", ".join(f"{v} {k}" for k, v in sorted(tally.cleaned.items())) or "nothing"
    figures.add(
        "crash",
        f"SIGKILL of a process fetching from {PATH_LABELS[path]}{SERVER_LABELS[server]} "
        f"({lock_mode} locks) at "
        + ", ".join(f"{k} x{tally.kills[k]}" for k in INSTANTS)
        + f" (random kills landed: {landed})",
        sum(tally.kills.values()),
        "0 corrupt or partial shards; the next fetch never waited (lock timeout and lease "
        f"a day): {recovery}; clean removed {cleaned}, none remained",
        path=path,
        server="moto" if server == "s3" else server,
        lock_mode=lock_mode,
        kills=dict(tally.kills),
        random_landed=dict(tally.random_landed),
        recovery=dict(tally.recovery),
        cleaned=dict(tally.cleaned),
    )
