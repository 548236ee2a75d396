"""Freshness: local sources revalidated on every hit (size and mtime), remote ones immutable
unless SHARDCACHE_REVALIDATE asks the store (one HEAD per interval per shard)."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import collect

from shardcache import ConfigError, RemoteNotFoundError, ShardCache
from shardcache._disk.metadata import read_meta, write_meta
from shardcache._locking.shard_lock import ShardLock
from shardcache._store import freshness
from shardcache._store.shard_ids import ShardIds

pytestmark = pytest.mark.timeout(120)
BUCKET = "fresh"
CTX = mp.get_context("spawn")


def _cache(tmp_path: Path, **options) -> ShardCache:
    return ShardCache(tmp_path / "cache", retry_backoff=0.01, **options)


def _rewrite(path: Path, data: bytes) -> None:
    """Rewrite ``path`` in place with a modification time surely not the old one."""
    old = path.stat().st_mtime_ns
    path.write_bytes(data)
    os.utime(path, ns=(old + 1_000_000_000, old + 1_000_000_000))


# -- local sources -----------------------------------------------------------------------


@pytest.mark.parametrize("new", [b"B" * 4096, b"B" * 5000], ids=["same-size", "new-size"])
def test_a_local_shard_rewritten_in_place_is_fetched_again(tmp_path: Path, new: bytes) -> None:
    source = tmp_path / "shard.tar"
    source.write_bytes(b"A" * 4096)
    cache = _cache(tmp_path)
    assert cache.fetch(str(source)).read_bytes() == b"A" * 4096
    _rewrite(source, new)
    assert not cache.contains(str(source))
    assert cache.fetch(str(source)).read_bytes() == new
    with cache.open(source.as_uri()) as f:  # the same entry under its file:// spelling
        assert f.read() == new
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (2, 1)


def test_an_unchanged_local_shard_is_a_hit(tmp_path: Path) -> None:
    source = tmp_path / "shard.tar"
    source.write_bytes(os.urandom(10_000))
    cache = _cache(tmp_path)
    inode = cache.fetch(str(source)).stat().st_ino
    for _ in range(3):
        assert cache.fetch(str(source)).stat().st_ino == inode
    assert cache.contains(str(source))
    assert (cache.stats().misses, cache.stats().hits) == (1, 3)


def test_the_remembered_stamps_are_bounded_and_a_forgotten_one_is_read_again(
    tmp_path: Path,
) -> None:
    cache = _cache(tmp_path)
    sources = []
    for i in range(5):
        source = tmp_path / f"shard-{i}.tar"
        source.write_bytes(bytes([i]) * 1000)
        sources.append(source)
        cache.fetch(str(source))
    fresh = freshness.Freshness(cache.layout, cache.remote, 0.0, recorded_limit=3)
    ids = ShardIds(cache.layout, cache.remote.storage_options_for)

    def current(source: Path) -> bool:
        shard = ids.identify(str(source))
        return fresh.is_current(shard, shard.data_path.lstat(), ask_store=True)

    assert all(current(source) for source in sources)  # each (re)remembered, oldest dropped
    assert len(fresh._recorded) == 3
    _rewrite(sources[0], b"new" * 100)  # forgotten long ago: its record is read again
    assert not current(sources[0])
    assert cache.fetch(str(sources[0])).read_bytes() == b"new" * 100
    assert current(sources[0])


def test_a_later_process_sees_the_rewrite(tmp_path: Path) -> None:
    source = tmp_path / "shard.tar"
    source.write_bytes(b"old" * 1000)
    _cache(tmp_path).fetch(str(source))
    _rewrite(source, b"new" * 1000)
    script = (
        "import hashlib, sys; from shardcache import ShardCache; "
        "p = ShardCache(sys.argv[1]).fetch(sys.argv[2]); "
        "print(hashlib.sha256(p.read_bytes()).hexdigest())"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cache"), str(source)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == hashlib.sha256(b"new" * 1000).hexdigest()


def _fetch_digest(cache_dir: str, url: str, start: mp.synchronize.Event, out: mp.Queue) -> None:
    start.wait(30)
    cache = ShardCache(cache_dir)
    path = cache.fetch(url)
    stats = cache.stats()
    out.put((hashlib.sha256(path.read_bytes()).hexdigest(), stats.misses, stats.shared))


def test_processes_racing_on_a_stale_copy_all_get_the_new_bytes(tmp_path: Path) -> None:
    """Under the lock, a stale copy is not taken for one another process just published."""
    source = tmp_path / "shard.tar"
    source.write_bytes(os.urandom(2 << 20))
    _cache(tmp_path).fetch(str(source))
    new = os.urandom(2 << 20)
    _rewrite(source, new)
    start, out = CTX.Event(), CTX.Queue()
    procs = [
        CTX.Process(target=_fetch_digest, args=(str(tmp_path / "cache"), str(source), start, out))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    start.set()
    results = collect(out, procs, len(procs))
    for p in procs:
        p.join(30)
    assert {digest for digest, _, _ in results} == {hashlib.sha256(new).hexdigest()}
    assert sum(misses for _, misses, _ in results) == 1  # one download; the others waited or hit


def _fetch_after_lock(cache_dir: str, url: str, waiting: mp.Queue, out: mp.Queue) -> None:
    cache = ShardCache(cache_dir, lock_timeout=60)
    told: list[str] = []

    def progress(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        if phase.startswith("waiting") and not told:
            told.append(phase)
            waiting.put(os.getpid())

    path = cache.fetch(url, progress=progress)
    stats = cache.stats()
    out.put((path.read_bytes(), stats.misses, stats.shared, stats.hits))


def test_a_stale_copy_is_not_taken_for_another_processs_work(tmp_path: Path) -> None:
    """Two processes find the stale copy while its lock is held: both wait (the stale file is
    not "published by another process"), then one fetches and the other shares its copy."""
    source = tmp_path / "shard.tar"
    source.write_bytes(b"O" * 4000)
    cache = _cache(tmp_path)
    cache.fetch(str(source))
    _rewrite(source, b"N" * 6000)
    lock = ShardLock(
        cache._identify(str(source)).lock_path,
        url=str(source),
        policy=cache._locks.policy(),
    )
    assert lock.acquire()
    waiting, out = CTX.Queue(), CTX.Queue()
    args = (str(tmp_path / "cache"), str(source), waiting, out)
    procs = [CTX.Process(target=_fetch_after_lock, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        assert set(collect(waiting, procs, len(procs))) == {p.pid for p in procs}
        lock.release()
        results = collect(out, procs, len(procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [r[0] for r in results] == [b"N" * 6000] * 2
    assert sorted(r[1:] for r in results) == [(0, 1, 0), (1, 0, 0)]


def test_a_record_written_for_a_new_copy_does_not_bless_the_old_one(tmp_path: Path) -> None:
    """The metadata is written just before the new copy replaces the old: in that window the
    record (naming the new copy's inode) must not make the old copy look current."""
    source = tmp_path / "shard.tar"
    source.write_bytes(b"O" * 4000)
    cache = _cache(tmp_path)
    path = cache.fetch(str(source))
    _rewrite(source, b"N" * 4000)
    meta = read_meta(cache.layout, path)
    st = os.stat(source)
    meta.update(size=st.st_size, mtime_ns=st.st_mtime_ns, data_ino=path.stat().st_ino + 1)
    write_meta(cache.layout, path, meta)  # as the publisher of the new copy would, pre-rename
    assert not _cache(tmp_path).contains(str(source))
    assert _cache(tmp_path).fetch(str(source)).read_bytes() == b"N" * 4000


def test_a_deleted_local_source_is_not_served_from_the_cache(tmp_path: Path) -> None:
    source = tmp_path / "shard.tar"
    source.write_bytes(b"x" * 100)
    cache = _cache(tmp_path)
    cache.fetch(str(source))
    source.unlink()
    with pytest.raises(RemoteNotFoundError):
        cache.fetch(str(source))


def test_a_copy_without_a_recorded_source_version_is_fetched_again(tmp_path: Path) -> None:
    """Entries cached before versions were recorded are refreshed once, then hit."""
    source = tmp_path / "shard.tar"
    source.write_bytes(b"x" * 100)
    cache = _cache(tmp_path)
    path = cache.fetch(str(source))
    meta = read_meta(cache.layout, path)
    del meta["mtime_ns"]
    write_meta(cache.layout, path, meta)
    fresh = _cache(tmp_path)
    fresh.fetch(str(source))
    fresh.fetch(str(source))
    assert (fresh.stats().misses, fresh.stats().hits) == (1, 1)


# -- remote sources ----------------------------------------------------------------------


def _age_check(cache: ShardCache, url: str, seconds: float) -> None:
    """Make the copy's last check ``seconds`` old (instead of waiting that long)."""
    path = cache.path_for(url)
    meta = read_meta(cache.layout, path)
    meta["fetched_at"] = meta.pop("checked_at", meta["fetched_at"]) - seconds
    write_meta(cache.layout, path, meta)


def test_remote_objects_are_immutable_by_default(s3, tmp_path: Path) -> None:
    s3.put_objects(BUCKET, {"a.tar": b"old" * 1000})
    cache = _cache(tmp_path)
    url = f"s3://{BUCKET}/a.tar"
    cache.fetch(url)
    s3.put_objects(BUCKET, {"a.tar": b"new" * 1000})
    heads = s3.count("HEAD", BUCKET, "a.tar")
    _age_check(cache, url, 10 * 86400)
    assert cache.fetch(url).read_bytes() == b"old" * 1000
    assert s3.count("HEAD", BUCKET, "a.tar") == heads  # a hit asks nothing


def test_revalidation_asks_once_per_interval_and_refetches_a_changed_object(
    s3, tmp_path: Path
) -> None:
    s3.put_objects(BUCKET, {"b.tar": b"old" * 1000})
    cache = _cache(tmp_path, revalidate=60)
    url = f"s3://{BUCKET}/b.tar"
    cache.fetch(url)
    heads, gets = s3.count("HEAD", BUCKET, "b.tar"), s3.count("GET", BUCKET, "b.tar")
    assert (heads, gets) == (0, 1)  # a cold fetch is one GET
    s3.put_objects(BUCKET, {"b.tar": b"new!" * 1000})
    assert cache.fetch(url).read_bytes() == b"old" * 1000  # within the interval: no question
    assert s3.count("HEAD", BUCKET, "b.tar") == heads
    _age_check(cache, url, 61)
    assert cache.fetch(url).read_bytes() == b"new!" * 1000
    heads_after = s3.count("HEAD", BUCKET, "b.tar")
    assert heads_after - heads == 1  # the check (a HEAD); the refetch is one GET
    assert s3.count("GET", BUCKET, "b.tar") == gets + 1
    for _ in range(3):
        assert cache.fetch(url).read_bytes() == b"new!" * 1000
    assert s3.count("HEAD", BUCKET, "b.tar") == heads_after


def test_an_unchanged_object_is_checked_once_per_interval_across_processes(
    s3, tmp_path: Path
) -> None:
    s3.put_objects(BUCKET, {"c.tar": b"same" * 1000})
    url = f"s3://{BUCKET}/c.tar"
    cache = _cache(tmp_path, revalidate=60)
    cache.fetch(url)
    _age_check(cache, url, 61)
    heads = s3.count("HEAD", BUCKET, "c.tar")
    cache.fetch(url)
    assert s3.count("HEAD", BUCKET, "c.tar") == heads + 1
    other = _cache(tmp_path, revalidate=60)  # another process's view: the check time is shared
    other.fetch(url)
    assert s3.count("HEAD", BUCKET, "c.tar") == heads + 1
    assert (cache.stats().hits, other.stats().hits, cache.stats().misses) == (1, 1, 1)


def test_an_unreachable_store_serves_the_copy_with_a_warning(
    s3, fault_proxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s3.put_objects(BUCKET, {"d.tar": b"kept" * 1000})
    url = f"s3://{BUCKET}/d.tar"
    cache = _cache(
        tmp_path,
        revalidate=60,
        retries=1,
        slowdown_retry_time=0,  # every refusal an attempt: 2 attempts
        storage_options={"endpoint_url": fault_proxy.endpoint_url},
    )
    cache.fetch(url)
    _age_check(cache, url, 61)
    fault_proxy.add_fault("status:503", times=None, method="HEAD", path_contains="d.tar")
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        assert cache.fetch(url).read_bytes() == b"kept" * 1000
    assert "cannot revalidate" in caplog.text
    assert len(fault_proxy.stats().injected) == 2  # the attempt and its one retry


def test_a_deleted_object_is_not_served_once_revalidation_finds_it_gone(s3, tmp_path: Path) -> None:
    s3.put_objects(BUCKET, {"e.tar": b"x" * 1000})
    url = f"s3://{BUCKET}/e.tar"
    cache = _cache(tmp_path, revalidate=60)
    cache.fetch(url)
    s3.boto3_client().delete_object(Bucket=BUCKET, Key="e.tar")
    _age_check(cache, url, 61)
    with pytest.raises(RemoteNotFoundError):
        cache.fetch(url)


def test_revalidate_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDCACHE_REVALIDATE", "soon")
    with pytest.raises(ConfigError, match="SHARDCACHE_REVALIDATE"):
        ShardCache()
    monkeypatch.setenv("SHARDCACHE_REVALIDATE", "10m")
    assert ShardCache().settings.revalidate == 600
