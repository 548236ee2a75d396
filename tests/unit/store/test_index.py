"""The scope's index (sqlite): kept by several processes at once, exact after crashes,
rebuilt when missing, damaged, of another version or stale, and no directory listing on
the miss path of a size-bounded cache."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import run_together

from shardcache import ShardCache
from shardcache._disk.layout import is_temp_name
from shardcache._store.eviction import evict_lock, listings
from shardcache._store.index import Index

SIZE = 10_000


def _sources(tmp_path: Path, n: int, name: str = "src") -> list[str]:
    src = tmp_path / name
    src.mkdir(exist_ok=True)
    urls = []
    for i in range(n):
        path = src / f"shard-{i:06d}.tar"
        path.write_bytes(bytes([i % 256]) * SIZE)
        urls.append(str(path))
    return urls


def _on_disk(scope: Path) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """Published shards (``hh/name`` -> (size, inode)) and temp files under ``data/``."""
    shards, parts = {}, set()
    for bucket in (scope / "data").iterdir():
        for f in bucket.iterdir():
            rel = f"{bucket.name}/{f.name}"
            if is_temp_name(f.name):
                parts.add(rel)
            else:
                st = f.lstat()
                shards[rel] = (st.st_size, st.st_ino)
    return shards, parts


def _indexed(scope: Path) -> tuple[dict[str, tuple[int, int]], set[str], int]:
    """What the index says: shards, parts, and its running total of bytes."""
    conn = sqlite3.connect(scope / ".locks" / "index.sqlite")
    try:
        shards = {n: (s, i) for n, s, i in conn.execute("SELECT name, size, ino FROM entries")}
        parts = {n for (n,) in conn.execute("SELECT name FROM parts")}
        (total,) = conn.execute("SELECT value FROM state WHERE key = 'total_bytes'").fetchone()
    finally:
        conn.close()
    return shards, parts, total


def _assert_exact(scope: Path) -> None:
    shards, parts, total = _indexed(scope)
    on_disk, temps = _on_disk(scope)
    assert shards == on_disk
    assert parts == temps
    assert total == sum(size for size, _ in on_disk.values())


def _scope(cache: ShardCache) -> Path:
    return cache.settings.scope_dir


# ------------------------------------------------------------------- incremental, shared


def _publisher(cache_dir: str, urls: list[str], start, out) -> None:
    cache = ShardCache(cache_dir, scope="node", max_bytes=1 << 30)
    start.wait()
    for url in urls:
        cache.fetch(url)
    index = cache._space.index()
    assert index is not None
    out.put(index.counters.rebuilds)


def test_processes_publishing_at_once_keep_one_exact_index(tmp_path: Path) -> None:
    urls = _sources(tmp_path, 40)
    # Four processes, overlapping halves: every shard fetched by two of them.
    slices = [urls[0:20], urls[10:30], urls[20:40], urls[30:40] + urls[0:10]]
    rebuilds = run_together(_publisher, [(str(tmp_path / "c"), s) for s in slices])
    assert sum(rebuilds) == 1, "built once (empty) by the first, then kept incrementally"
    cache = ShardCache(tmp_path / "c", scope="node")
    _assert_exact(_scope(cache))
    assert len(_indexed(_scope(cache))[0]) == 40


# ------------------------------------------------------------------------ miss path


def test_a_miss_of_a_bounded_cache_lists_no_directory(tmp_path: Path) -> None:
    urls = _sources(tmp_path, 60)
    cache = ShardCache(tmp_path / "c", max_bytes=20 * SIZE)
    for url in urls[:20]:
        cache.fetch(url)  # the first miss builds the index (one listing of an empty cache)
    before = listings()
    for url in urls[20:]:
        cache.fetch(url)  # each of these evicts one
        cache.fetch(url)  # and a hit
    assert listings() == before, "a miss, an eviction or a hit listed a directory"
    assert len(_on_disk(_scope(cache))[0]) == 20
    _assert_exact(_scope(cache))


def test_the_evictor_corrects_last_used_from_the_files(tmp_path: Path) -> None:
    urls = _sources(tmp_path, 6)
    cache = ShardCache(tmp_path / "c", max_bytes=4 * SIZE)
    for n, url in enumerate(urls[:4]):
        cache.fetch(url)
        t = time.time() - 1000 + n  # used long ago, oldest first
        os.utime(cache.path_for(url), (t, t))
    cache.fetch(urls[0])  # hits refresh the files' mtimes, not the index
    cache.fetch(urls[1])
    cache.fetch(urls[4])
    cache.fetch(urls[5])
    assert [cache.contains(u) for u in urls] == [True, True, False, False, True, True]
    index = cache._space.index()
    assert index is not None and index.counters.corrections >= 2
    _assert_exact(_scope(cache))


# ------------------------------------------------------------------------- rebuilds


def _fill(tmp_path: Path, n: int = 5) -> tuple[ShardCache, list[str]]:
    urls = _sources(tmp_path, n + 3)
    cache = ShardCache(tmp_path / "c", max_bytes=n * SIZE)
    for url in urls[:n]:
        cache.fetch(url)
    return cache, urls


def _index_files(scope: Path) -> list[Path]:
    return [scope / ".locks" / f"index.sqlite{s}" for s in ("", "-wal", "-shm")]


def test_a_deleted_index_is_rebuilt_from_the_directory(tmp_path: Path) -> None:
    cache, urls = _fill(tmp_path)
    for f in _index_files(_scope(cache)):
        f.unlink(missing_ok=True)
    cache.fetch(urls[5])  # evicts the oldest, which only a rebuilt index knows
    index = cache._space.index()
    assert index is not None and index.counters.rebuilds == 2
    assert not cache.contains(urls[0]) and cache.contains(urls[1])
    _assert_exact(_scope(cache))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other-version"])
def test_a_damaged_or_foreign_index_is_rebuilt(tmp_path: Path, damage: str) -> None:
    cache, urls = _fill(tmp_path)
    scope = _scope(cache)
    index_file = _index_files(scope)[0]
    cache._space.index().close()  # type: ignore[union-attr]
    if damage == "other-version":
        conn = sqlite3.connect(index_file)
        conn.execute("PRAGMA user_version = 99")
        conn.close()
    else:
        for f in _index_files(scope)[1:]:
            f.unlink(missing_ok=True)
        data = index_file.read_bytes()
        index_file.write_bytes(b"not a database " * 100 if damage == "garbage" else data[:100])
    other = ShardCache(tmp_path / "c", max_bytes=5 * SIZE)  # another process, say
    other.fetch(urls[5])
    assert other._space.index().counters.rebuilds == 1  # type: ignore[union-attr]
    assert not other.contains(urls[0])
    _assert_exact(scope)
    assert len(_on_disk(scope)[0]) == 5


def test_shards_removed_behind_the_index_are_dropped_when_met(tmp_path: Path) -> None:
    cache, urls = _fill(tmp_path)
    for url in urls[:2]:  # a tmp cleaner, `rm`, another user
        cache.path_for(url).unlink()
    cache.fetch(urls[5])
    cache.fetch(urls[6])  # room without evicting anything: the two gone ones were counted
    assert all(cache.contains(u) for u in urls[2:7])
    index = cache._space.index()
    assert index is not None and index.counters.corrections == 2 and index.counters.rebuilds == 1
    _assert_exact(_scope(cache))


def test_shards_added_behind_the_index_are_found_by_the_periodic_reconcile(
    tmp_path: Path,
) -> None:
    cache, _urls = _fill(tmp_path)
    unbounded = ShardCache(tmp_path / "c")  # does not keep the index
    extra = _sources(tmp_path, 3, name="extra")
    for url in extra:
        unbounded.fetch(url)
    # The index of a process that reconciles every 4 operations (or as many as it has
    # entries, 5): the filling counted more, so it is reconciled before its first eviction,
    # which then makes room for what it had not known: the scope is within its bound again.
    index = Index(cache.layout, reconcile_every=4)
    with evict_lock(cache.layout):
        index.evict(5 * SIZE)
    assert index.counters.reconciles >= 1
    assert sum(size for size, _ in _on_disk(_scope(cache))[0].values()) <= 5 * SIZE
    _assert_exact(_scope(cache))


def test_explicit_evict_is_exact_whatever_the_index_says(tmp_path: Path) -> None:
    cache, _urls = _fill(tmp_path)
    unbounded = ShardCache(tmp_path / "c")
    for url in _sources(tmp_path, 3, name="extra"):
        unbounded.fetch(url)
    report = cache.evict(4 * SIZE)
    assert len(report.removed) == 4 and report.kept_bytes == 4 * SIZE
    assert len(_on_disk(_scope(cache))[0]) == 4
    _assert_exact(_scope(cache))


def test_no_room_by_the_index_rebuilds_before_giving_up(tmp_path: Path) -> None:
    cache, urls = _fill(tmp_path)
    scope = _scope(cache)
    # A count too high with no row to show for it (a lost update, say): the evictor walks
    # every row and still finds no room.
    conn = sqlite3.connect(scope / ".locks" / "index.sqlite")
    conn.execute("UPDATE state SET value = value + ? WHERE key = 'total_bytes'", (10 * SIZE,))
    conn.commit()
    conn.close()
    with cache.open(urls[4]):  # pinned
        cache.fetch(urls[5])
    index = cache._space.index()
    assert index is not None and index.counters.rebuilds == 2
    assert cache.contains(urls[4]) and cache.contains(urls[5])
    _assert_exact(scope)


# --------------------------------------------------------------------------- crashes

_CHILD = textwrap.dedent(
    """
    import sys
    from shardcache import ShardCache
    from shardcache._store import index

    cache_dir, where, max_bytes, *urls = sys.argv[1:]

    def stop():
        print("AT", flush=True)
        sys.stdin.read()  # the parent SIGKILLs us here

    if where == "published":
        def published(self, part, final):
            stop()
        index.Index.published = published
    elif where == "reserved":
        from shardcache._store import space
        real_reserve = space.Space.reserve
        def reserve(self, fd, info):
            real_reserve(self, fd, info)
            stop()  # space reserved, nothing downloaded
        space.Space.reserve = reserve
    else:
        real_remove, removed = index.remove, []
        def remove(layout, path):
            ok = real_remove(layout, path)
            removed.append(ok)
            if len(removed) == 2:
                stop()  # mid-eviction: two files gone, the transaction not committed
            return ok
        index.remove = remove

    cache = ShardCache(cache_dir, max_bytes=int(max_bytes))
    for url in urls:
        cache.fetch(url)
    print("DONE", flush=True)
    """
)


def _run_and_kill(cache_dir: Path, where: str, max_bytes: int, urls: list[str]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(cache_dir), where, str(max_bytes), *urls],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "AT"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_between_rename_and_record_leaves_a_repairable_index(tmp_path: Path) -> None:
    cache, urls = _fill(tmp_path)
    scope = _scope(cache)
    _run_and_kill(tmp_path / "c", "published", 6 * SIZE, [urls[5]])
    shards, parts, _ = _indexed(scope)
    assert cache.path_for(urls[5]).exists(), "renamed into place before the kill"
    assert len(parts) == 1 and len(shards) == 5, "registered as a part, not yet a shard"
    cache.fetch(urls[6])  # max 5 shards: the published-but-unrecorded one is counted
    on_disk = _on_disk(scope)[0]
    assert len(on_disk) == 5 and cache.contains(urls[5]) and cache.contains(urls[6])
    _assert_exact(scope)


def test_sigkill_mid_eviction_leaves_a_repairable_index(tmp_path: Path) -> None:
    cache, urls = _fill(tmp_path)
    scope = _scope(cache)
    big = tmp_path / "src" / "big.tar"
    big.write_bytes(b"b" * 3 * SIZE)  # needs three evictions
    _run_and_kill(tmp_path / "c", "evict", 5 * SIZE, [str(big)])
    assert len(_on_disk(scope)[0]) == 3, "two shards removed before the kill"
    assert len(_indexed(scope)[0]) == 5, "their removal was not committed"
    # The rows of the two removed shards are the oldest: the evictor meets them first
    # whenever it needs room, drops them and evicts nothing for those two fetches.
    cache.fetch(urls[5])
    cache.fetch(urls[6])
    assert [cache.contains(u) for u in urls[:7]] == [False, False, True, True, True, True, True]
    _assert_exact(scope)
    assert cache._space.index().counters.rebuilds == 1  # type: ignore[union-attr]


def test_a_crashed_download_counts_until_the_next_room_made_removes_it(tmp_path: Path) -> None:
    from shardcache._ops.maintenance import clean

    urls = _sources(tmp_path, 6)
    cache = ShardCache(tmp_path / "c", max_bytes=6 * SIZE)
    for url in urls[:4]:
        cache.fetch(url)
    big = tmp_path / "src" / "big.tar"
    big.write_bytes(b"b" * 2 * SIZE)
    _run_and_kill(tmp_path / "c", "reserved", 6 * SIZE, [str(big)])
    assert len(_indexed(_scope(cache))[1]) == 1, "the dead download's reservation"
    # Making room, the count meets the dead download's part and removes it instead of
    # evicting a shard: 4 + 1 <= 6.
    cache.fetch(urls[4])
    assert all(cache.contains(u) for u in urls[:5])
    assert _indexed(_scope(cache))[1] == set(), "its row went with its file"
    assert clean(cache).removed == []
    cache.fetch(urls[5])  # 5 + 1 <= 6: nothing goes
    assert all(cache.contains(u) for u in urls)
    _assert_exact(_scope(cache))


# ------------------------------------------------------------------------ maintenance


def test_verify_quick_checks_sizes_against_the_records_without_the_source(
    tmp_path: Path,
) -> None:
    urls = _sources(tmp_path, 4)
    cache = ShardCache(tmp_path / "c", max_bytes=10 * SIZE)
    for url in urls:
        cache.fetch(url)
    os.truncate(cache.path_for(urls[1]), 100)
    for url in urls:  # the sources are gone: a full verify could not check anything
        Path(url).unlink()
    stray = _scope(cache) / "data" / "zz" / "copied-by-hand.tar"
    stray.parent.mkdir()
    stray.write_bytes(b"who knows")
    env = {**os.environ, "SHARDCACHE_DIR": str(tmp_path / "c")}
    done = subprocess.run(
        [sys.executable, "-m", "shardcache", "verify", "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "5 shards, 3 ok, 1 bad, 0 not checkable, 1 of unknown origin" in done.stdout
    assert f"bad: file://{urls[1]}: size 100 bytes, {SIZE} recorded when it was cached; " in (
        done.stdout
    )
    assert not cache.path_for(urls[1]).exists() and stray.exists()
    # Removed through the cache: the index knows (no rebuild needed to be exact).
    shards, _parts, total = _indexed(_scope(cache))
    assert cache.path_for(urls[1]).parent.name + "/" + cache.path_for(urls[1]).name not in shards
    assert total == 3 * SIZE
