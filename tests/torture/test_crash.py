"""SIGKILL a fetching process at chosen and random instants, then check the cache.

After every kill: each published shard is byte-identical to its source, the next fetch
succeeds at once (flock: the kernel freed the lock; lease: the dead pid's lease is broken
without waiting for it to expire), and ``clean`` removes every leftover.
"""

from __future__ import annotations

import collections
import contextlib
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import scale

from shardcache import ShardCache, maintenance
from shardcache.layout import is_temp_name

CHILD = Path(__file__).with_name("crash_child.py")
INSTANTS = ("locked", "download", "verify", "meta", "rename", "renamed", "random")
LINE_TIMEOUT = 30.0  # a child that has not reached its instant by then is a failure
RECOVERY_LIMIT = 5.0  # lock_timeout / lease_time are 120 s: recovery must not wait


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """One line from the child's stdout, bounded by ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"child {proc.pid} said nothing for {timeout}s")
    return proc.stdout.readline().decode().strip()


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


@pytest.mark.parametrize("lock_mode", ["flock", "lease"])
def test_sigkill_at_random_instants(tmp_path: Path, lock_mode: str, figures) -> None:  # noqa: PLR0915
    iterations = scale(10, 100)  # per lock mode: 20 in CI, 200 in the full run
    rng = random.Random(f"crash-{lock_mode}")
    src = tmp_path / "src"
    src.mkdir()
    sources: dict[str, bytes] = {}
    for i in range(8):
        data = rng.randbytes(rng.randrange(40_000, 200_000))
        (src / f"train-{i:06d}.tar").write_bytes(data)
        sources[str(src / f"train-{i:06d}.tar")] = data
    cache_dir = tmp_path / "cache"
    cache = ShardCache(
        cache_dir, scope="node", lock_mode=lock_mode, lock_timeout=120, lease_time=120
    )
    scope = cache.settings.scope_dir
    reached: collections.Counter[str] = collections.Counter()
    worst_recovery = 0.0
    cleaned = 0
    for it in range(iterations):
        url = rng.choice(list(sources))
        data = sources[url]
        if cache.contains(url):
            assert cache.remove(cache.path_for(url))
        instant = INSTANTS[it % len(INSTANTS)] if it < len(INSTANTS) else rng.choice(INSTANTS)
        offset = rng.randrange(0, len(data))
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(cache_dir), url, lock_mode, instant, str(offset)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            line = _read_line(proc, LINE_TIMEOUT)
            if instant == "random":
                assert line == "GO", line
                # A random instant: anywhere in the fetch, or after it.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=rng.uniform(0.0, 0.08))
                reached["random"] += 1
            else:
                assert line == f"AT {instant}", f"iteration {it}: {line!r}"
                reached[instant] += 1
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdin.close()
            proc.stdout.close()

        # 1. Nothing but complete shards at final names.
        for entry in cache.entries():
            assert entry.url is not None, f"published shard without metadata: {entry.path}"
            assert entry.path.read_bytes() == sources[entry.url.removeprefix("file://")]
        # 2. The next fetch succeeds without waiting for the dead holder.
        started = time.monotonic()
        assert cache.fetch(url).read_bytes() == data
        elapsed = time.monotonic() - started
        worst_recovery = max(worst_recovery, elapsed)
        assert elapsed < RECOVERY_LIMIT, f"{instant}: recovery took {elapsed:.1f}s"
        # 3. clean removes every leftover (a .part, a lease, a claim) of the dead process.
        report = maintenance.clean(cache)
        cleaned += len(report.removed)
        assert not report.failed, report.format()
        assert not _leftovers(scope), (instant, _leftovers(scope), report.format())
        status = maintenance.status(cache)
        assert not status.stale_locks and not status.orphans, status.format()

    for url, data in sources.items():  # the survivors are all intact and fetchable
        assert cache.fetch(url).read_bytes() == data
    assert set(reached) == set(INSTANTS)
    figures.add(
        "crash",
        f"SIGKILL of a fetching process ({lock_mode} locks) at "
        + ", ".join(f"{k} x{v}" for k, v in sorted(reached.items())),
        iterations,
        f"0 corrupt or partial shards; next fetch always succeeded (worst {worst_recovery:.2f}s, "
        f"lock timeout and lease 120 s); clean removed {cleaned} leftovers, none remained",
    )
