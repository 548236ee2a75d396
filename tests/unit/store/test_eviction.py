"""Size-bounded cache: LRU eviction while fetching, pins, and CacheFullError."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import subprocess
import time
from pathlib import Path

import pytest
from processes import run_together, wait_set

from shardcache import CacheFullError, ConfigError, ShardCache
from shardcache._ops.maintenance import status

SIZE = 100_000
CTX = mp.get_context("spawn")


@pytest.fixture
def sources(tmp_path: Path) -> list[str]:
    src = tmp_path / "src"
    src.mkdir()
    urls = []
    for i in range(6):
        path = src / f"shard-{i:06d}.tar"
        path.write_bytes(bytes([i]) * SIZE)
        urls.append(str(path))
    return urls


def _data_bytes(cache: ShardCache) -> int:
    return sum(e.size for e in cache.entries())


def _age(cache: ShardCache, url: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(cache.path_for(url), (t, t))


def test_max_bytes_is_enforced_while_fetching_lru_first(sources, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", max_bytes=int(3.5 * SIZE))
    for n, url in enumerate(sources):
        cache.fetch(url)
        _age(cache, url, 1000 - n)  # fetch order = age order, oldest first
        assert _data_bytes(cache) <= 3.5 * SIZE
    assert [cache.contains(u) for u in sources] == [False, False, False, True, True, True]
    assert all(
        p.read_bytes() == bytes([i + 3]) * SIZE
        for i, p in enumerate(cache.path_for(u) for u in sources[3:])
    )


def test_a_hit_makes_a_shard_recently_used(sources, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", max_bytes=3 * SIZE)
    for n, url in enumerate(sources[:3]):
        cache.fetch(url)
        _age(cache, url, 1000 - n)
    cache.fetch(sources[0])  # hit: the oldest becomes the newest
    cache.fetch(sources[3])
    assert cache.contains(sources[0]) and not cache.contains(sources[1])


def test_open_shards_are_never_evicted(sources, tmp_path: Path) -> None:
    # open() returns once the shards are published (not while they download: the pins of
    # shards read while downloading are tested in test_read_while_downloading.py).
    cache = ShardCache(tmp_path / "cache", max_bytes=2 * SIZE, read_while_downloading="off")
    with cache.open(sources[0]) as a, cache.open(sources[1]) as b:
        with pytest.raises(CacheFullError) as info:
            cache.fetch(sources[2])
        assert info.value.in_use == 2 and info.value.needed == SIZE
        assert "SHARDCACHE_MAX_BYTES" in str(info.value) and sources[2] in str(info.value)
        assert a.read() == bytes([0]) * SIZE and b.read(1) == b"\x01"
    assert not list((tmp_path / "cache").rglob("*.part"))
    cache.fetch(sources[2])  # released: now the LRU one goes
    assert sum(cache.contains(u) for u in sources[:3]) == 2


def _hold_open(cache_dir: str, url: str, ready, done) -> None:
    with ShardCache(cache_dir).open(url):
        ready.set()
        done.wait(60)


def test_a_shard_open_in_another_process_is_not_evicted(sources, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    cache.fetch(sources[0])
    ready, done = CTX.Event(), CTX.Event()
    child = CTX.Process(target=_hold_open, args=(str(tmp_path / "cache"), sources[0], ready, done))
    child.start()
    try:
        wait_set(ready, [child], "the child opening the shard")
        report = cache.evict(0)
        assert report.in_use == 1 and not report.removed and cache.contains(sources[0])
    finally:
        done.set()
        child.join(30)
    report = cache.evict(0)
    assert [e.url for e in report.removed] == ["file://" + sources[0]]
    assert not cache.contains(sources[0]) and report.kept_bytes == 0


def test_prefetched_unconsumed_shards_are_pinned(sources, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    with cache.prefetch(sources[:3], threads=2, depth=3) as shards:
        first = next(shards)
        # Bounded poll until the workers hold all three (published shards are pinned a
        # moment after their rename, so "all cached" is not yet "all pinned").
        deadline = time.monotonic() + 30
        while status(cache).in_use < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        report = cache.evict(0)
        assert report.in_use == 3 and not report.removed, "held + 2 prefetched"
        assert first.path.read_bytes() == bytes([0]) * SIZE
        next(shards)  # the consumer is done with the first shard: released
        assert [e.url for e in cache.evict(0).removed] == ["file://" + sources[0]]
    assert len(cache.evict(0).removed) == 2, "close() released the rest"


def test_a_shard_larger_than_max_bytes_is_refused(sources, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", max_bytes=SIZE // 2)
    with pytest.raises(CacheFullError, match="alone exceeds SHARDCACHE_MAX_BYTES"):
        cache.fetch(sources[0])


def test_entries_remove_and_evict_api(sources, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    for url in sources[:2]:
        cache.fetch(url)
    entries = cache.entries()
    assert sorted(e.url for e in entries) == sorted("file://" + u for u in sources[:2])
    assert all(e.size == SIZE for e in entries)
    assert cache.remove(entries[0].path) and not cache.remove(entries[0].path)
    assert len(cache.entries()) == 1
    with pytest.raises(ConfigError, match="SHARDCACHE_MAX_BYTES"):
        cache.evict()


@pytest.fixture
def tiny_disk(tmp_path: Path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert result.returncode == 0, f"cannot mount a 256 KiB tmpfs: {result.stderr.strip()}"
    yield mount
    gc.collect()  # a cache kept alive by a traceback still holds directory descriptors there
    for args in (["umount"], ["umount", "-l"]):  # lazily if something still holds it
        if not os.path.ismount(mount):
            break
        with contextlib.suppress(Exception):
            subprocess.run([*args, str(mount)], check=False, timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts a 256 KiB tmpfs")
def test_a_full_disk_reports_cache_full_and_leaves_nothing(
    sources, tmp_path: Path, tiny_disk
) -> None:
    cache = ShardCache(tiny_disk)
    big = tmp_path / "src" / "big.tar"
    big.write_bytes(b"x" * 200_000)
    cache.fetch(sources[0])
    cache.fetch(sources[1])  # 2 x 100 kB on a 256 KiB disk
    # Both shards in use, so nothing is evictable:
    with cache.open(sources[0]), cache.open(sources[1]), pytest.raises(CacheFullError) as info:
        cache.fetch(str(big))
    assert info.value.needed == 200_000 and info.value.in_use == 2
    assert info.value.in_use_bytes == 2 * SIZE and info.value.evictable == 0
    assert not list(tiny_disk.rglob("*.part")), "nothing partial left on the full disk"
    assert cache.fetch(str(big)).read_bytes() == b"x" * 200_000  # unpinned: LRU makes room
    assert not cache.contains(sources[0])


def _reader(cache_dir: str, urls: list[str], seed: int, rounds: int, start, out) -> None:
    import hashlib
    import random
    from concurrent.futures import ThreadPoolExecutor

    cache = ShardCache(cache_dir, scope="node", max_bytes=10 * SIZE)
    rng = random.Random(seed)
    picks = [rng.randrange(len(urls)) for _ in range(rounds)]

    def read(i: int) -> tuple[int, str]:
        with cache.open(urls[i]) as f:
            return i, hashlib.sha256(f.read()).hexdigest()

    start.wait()
    with ThreadPoolExecutor(max_workers=2) as pool:
        out.put(list(pool.map(read, picks)))


def test_processes_reading_under_constant_eviction_see_only_complete_shards(
    tmp_path: Path,
) -> None:
    import hashlib

    src = tmp_path / "src"
    src.mkdir()
    urls, digests = [], []
    for i in range(14):  # more shards than fit: eviction runs all the time
        data = os.urandom(SIZE)
        (src / f"s{i}.tar").write_bytes(data)
        urls.append(str(src / f"s{i}.tar"))
        digests.append(hashlib.sha256(data).hexdigest())
    results = run_together(_reader, [(str(tmp_path / "c"), urls, seed, 25) for seed in range(4)])
    assert sum(len(r) for r in results) == 100
    assert all(digest == digests[i] for r in results for i, digest in r)
    cache = ShardCache(tmp_path / "c", scope="node")
    assert sum(e.size for e in cache.entries()) <= 10 * SIZE
    assert not list((tmp_path / "c").rglob("*.part"))
