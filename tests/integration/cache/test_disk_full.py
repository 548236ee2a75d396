"""A cache disk that fills up, or turns read-only, while a download is running.

Real file systems only: a small tmpfs (or a loop-mounted ext4 image) is the cache directory,
the shard comes from the moto S3 server through a FaultProxy that slows every connection,
and once the first bytes have landed a separate process fills the disk (or the kernel
turns the file system read-only). With ``SHARDCACHE_PREALLOCATE=off`` nothing is reserved
up front, exactly as on a network or FUSE file system, so the disk fills mid-write.

The read-only case uses ext4's ``errors=remount-ro`` (triggered through
``/sys/fs/ext4/<dev>/trigger_fs_error``): that is how a cache disk turns read-only under a
running download. ``mount -o remount,ro`` cannot do it: Linux refuses it with EBUSY while
any file on the mount is open for writing, as the download's temp file is.

A cache directory that is full, read-only or cannot be made before anything starts is one
``CacheDirError`` when iteration starts, before any request.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import select
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardcache import CacheDirError, CacheFullError, ConfigError, ShardCache
from shardcache._cli.main import main
from shardcache._config.settings import Settings
from shardcache._disk.layout import is_temp_name
from shardcache.testing import FaultProxy, S3Server

BUCKET = "diskfull"
PAGE = 4096
CHUNK = 16 * 1024  # the downloads' chunk size: written to disk a chunk at a time
PART = 128 * 1024
PARTS = 3
SIZE = PARTS * PART  # 384 KiB: 3 parts when ranged
# Bytes/s per connection after FaultProxy's 64 KiB burst: the rest of a part takes 2 s, the
# rest of a single stream 10 s; a disk-full download stops long before.
RATE = 32 * 1024
WAIT = 30.0  # bound of every wait in these tests

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tmpfs")


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _one_object(s3: S3Server, seed: int) -> tuple[bytes, str]:
    """Upload one shard of SIZE bytes as ``a.tar``; requests are counted from here on."""
    data = _blob(SIZE, seed)
    s3.put_objects(BUCKET, {"a.tar": data})
    s3.clear_requests()
    return data, f"s3://{BUCKET}/a.tar"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def mount_point(tmp_path: Path) -> Iterator[Callable[[list[str]], Path]]:
    """Mount something (``mount`` arguments before the mount point) at a fresh directory;
    unmounted in a finally."""
    mounted: list[Path] = []

    def mount(args: list[str]) -> Path:
        mnt = tmp_path / f"mnt{len(mounted)}"
        mnt.mkdir()
        subprocess.run(["mount", *args, str(mnt)], check=True, timeout=30)
        mounted.append(mnt)
        return mnt

    try:
        yield mount
    finally:
        for mnt in reversed(mounted):
            subprocess.run(["umount", str(mnt)], check=False, timeout=30)
            if os.path.ismount(mnt):
                subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


@pytest.fixture
def tmpfs(mount_point: Callable[[list[str]], Path]) -> Path:
    return mount_point(["-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs"])


@pytest.fixture
def ext4(tmp_path: Path, mount_point: Callable[[list[str]], Path]) -> Path:
    """An 8 MiB ext4 image, loop-mounted with errors=remount-ro."""
    if os.geteuid() != 0:
        pytest.skip("needs root to loop-mount an ext4 image")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4 to make an ext4 image")
    image = tmp_path / "ext4.img"
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, timeout=60)
    return mount_point(["-o", "loop,errors=remount-ro", str(image)])


_FILLER = textwrap.dedent(
    """
    import errno, os, sys
    path, leave = sys.argv[1], int(sys.argv[2])
    print("ready", flush=True)
    sys.stdin.readline()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    block, filled = b"\\0" * 65536, 0
    while True:
        try:
            filled += os.write(fd, block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            break
    if leave:  # give back the last `leave` bytes: the disk keeps that much free
        filled = max(0, filled - leave)
        os.ftruncate(fd, filled)
    print("full", filled, flush=True)
    sys.stdin.readline()  # hold the space until told (or the test ends)
    """
)


class Filler:
    """A separate process that, on request, writes a file until the disk is full (then gives
    back ``leave`` bytes)."""

    def __init__(self, path: Path, leave: int = 0) -> None:
        self.path = path
        self.filled: int | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FILLER, str(path), str(leave)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], WAIT)
        assert ready, f"filler said nothing for {WAIT} s"
        return self.proc.stdout.readline().strip()

    def fill(self) -> int:
        """Fill the disk now; returns the bytes written once the disk is full."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        word, filled = self._line().split()
        assert word == "full"
        self.filled = int(filled)
        return self.filled

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(WAIT)


class OnFirstBytes:
    """A progress callback that runs ``action`` once, in the downloading thread, as soon as
    the first bytes of the shard are on disk (the download waits for it)."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action
        self.done = threading.Event()
        self.phases: list[str] = []

    def __call__(self, *, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        self.phases.append(phase)
        if phase == "downloading" and bytes_done > 0 and not self.done.is_set():
            self.done.set()
            self.action()


def _cache(root: Path, proxy: FaultProxy | None, s3: S3Server, ranged: bool) -> ShardCache:
    kw: dict = {
        "retry_backoff": 0.01,
        "chunk_size": CHUNK,
        "preallocate": "off",  # as on a network file system: nothing reserved
    }
    if ranged:
        kw.update(parallel_threshold=2 * PART, part_size=PART, parallel_parts=PARTS)
    else:
        kw.update(parallel_threshold=1 << 40)
    if proxy is not None:
        kw["storage_options"] = s3.storage_options(proxy.endpoint_url)
    return ShardCache(root / "cache", **kw)


def _temp_files(cache: ShardCache) -> list[Path]:
    scope = cache.settings.scope_dir
    return [p for p in scope.rglob("*") if p.is_file() and is_temp_name(p.name)]


def _wait_for_gets(s3: S3Server, key: str, count: int) -> None:
    """Until the server has seen ``count`` GETs of ``key`` (every part has started)."""
    deadline = time.monotonic() + WAIT
    while s3.count("GET", BUCKET, key) < count:  # each count() syncs with the server log
        assert time.monotonic() < deadline, f"the server saw fewer than {count} GETs of {key}"


@pytest.fixture
def slow_proxy(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", s3.port, conn_rate=RATE) as proxy:
        yield proxy


@needs_root
@pytest.mark.parametrize("ranged", [False, True], ids=["single-stream", "ranged"])
def test_disk_filling_mid_download_is_cache_full(
    s3: S3Server, slow_proxy: FaultProxy, tmpfs: Path, ranged: bool
) -> None:
    data, url = _one_object(s3, seed=1)
    cache = _cache(tmpfs, slow_proxy, s3, ranged)
    filler = Filler(tmpfs / "filler")
    parts = PARTS if ranged else 1

    def fill() -> None:
        _wait_for_gets(s3, "a.tar", parts)  # fill only once every request is in flight
        filler.fill()

    hook = OnFirstBytes(fill)
    try:
        with pytest.raises(CacheFullError) as info:
            cache.fetch(url, progress=hook)
        assert hook.done.is_set() and filler.filled
        err = info.value
        assert (err.needed, err.max_bytes, err.evictable, err.in_use) == (len(data), None, 0, 0)
        assert err.free < len(data)
        assert err.url == url and "filled up" in str(err) and "SHARDCACHE_DIR" in str(err)
        # Every request once: the full disk was not taken for a remote error and retried.
        assert s3.count("GET", BUCKET, "a.tar") == parts
        assert not _temp_files(cache)
        assert not cache.contains(url) and not cache.path_for(url).exists()
        assert cache.stats().errors == 1
    finally:
        filler.close()
    # Space freed: the same cache fetches the shard (unshaped now, to keep the test short).
    (tmpfs / "filler").unlink()
    slow_proxy.conn_rate = None
    assert _sha(cache.fetch(url).read_bytes()) == _sha(data)


@needs_root
def test_one_eviction_pass_and_one_retry_fill_the_shard(
    s3: S3Server, slow_proxy: FaultProxy, tmpfs: Path
) -> None:
    old, new = _blob(SIZE + 3 * PAGE, 2), _blob(SIZE, 3)
    s3.put_objects(BUCKET, {"old.tar": old, "new.tar": new})
    s3.clear_requests()
    # An evictable shard already cached (fetched directly, not through the slow proxy).
    direct = _cache(tmpfs, None, s3, ranged=False)
    old_path = direct.fetch(f"s3://{BUCKET}/old.tar")
    cache = _cache(tmpfs, slow_proxy, s3, ranged=False)
    filler = Filler(tmpfs / "filler")

    def fill() -> None:
        filler.fill()
        slow_proxy.conn_rate = None  # the retry need not crawl

    hook = OnFirstBytes(fill)
    url = f"s3://{BUCKET}/new.tar"
    try:
        path = cache.fetch(url, progress=hook)
        assert filler.filled and _sha(path.read_bytes()) == _sha(new)
        assert not old_path.exists()  # evicted to make room
        assert s3.count("GET", BUCKET, "new.tar") == 2  # the failed attempt and one retry
        assert hook.phases.count("publishing") == 1
        assert not _temp_files(cache)
        assert cache.stats().misses == 1 and cache.stats().errors == 0
    finally:
        filler.close()


@needs_root
def test_a_reader_following_a_download_that_filled_the_disk_goes_on_after_the_retry(
    s3: S3Server, fault_proxy: FaultProxy, tmpfs: Path
) -> None:
    """Reading while downloading: the disk fills up under the download a reader follows;
    one eviction pass makes room, the retry is published, and the reader goes on in the
    published file (its bytes compared with what it had read): the source's bytes.

    The proxy holds the body back after its first chunk, so the disk is filled while the
    download writes nothing (had it met the full disk during the fill, the eviction pass
    could have made room that the filler then took)."""
    old, new = _blob(SIZE + 3 * PAGE, 4), _blob(SIZE, 5)
    s3.put_objects(BUCKET, {"old.tar": old, "new.tar": new})
    s3.clear_requests()
    direct = _cache(tmpfs, None, s3, ranged=False)
    old_path = direct.fetch(f"s3://{BUCKET}/old.tar")
    cache = _cache(tmpfs, fault_proxy, s3, ranged=False)
    assert cache.settings.read_while_downloading == "on"  # the default
    held = fault_proxy.add_fault(
        "hold", times=1, method="GET", path_contains="new.tar", truncate_bytes=CHUNK
    )
    filler = Filler(tmpfs / "filler")
    url = f"s3://{BUCKET}/new.tar"
    try:
        with cache.open(url) as stream:
            head = stream.read(PAGE)  # of the chunk the proxy let through: the in-flight file
            assert not cache.contains(url)
            filler.fill()
            held.release()  # the download's next write meets the full disk
            rest = stream.read()
        assert filler.filled and _sha(head + rest) == _sha(new)
        assert not old_path.exists()  # evicted to make room
        assert s3.count("GET", BUCKET, "new.tar") == 2  # the stopped attempt and the retry
        assert _sha(cache.path_for(url).read_bytes()) == _sha(new)
        assert not _temp_files(cache)
    finally:
        held.release()
        filler.close()


@needs_root
def test_no_room_after_the_eviction_pass_gives_up_after_one_attempt(
    s3: S3Server, slow_proxy: FaultProxy, tmpfs: Path
) -> None:
    """max_bytes set, the only other shard pinned: the eviction pass frees nothing, so no
    retry is made and CacheFullError gives the numbers."""
    pinned, new = _blob(PART, 4), _blob(SIZE, 5)
    s3.put_objects(BUCKET, {"pinned.tar": pinned, "new.tar": new})
    s3.clear_requests()
    cache = ShardCache(
        tmpfs / "cache",
        retry_backoff=0.01,
        chunk_size=CHUNK,
        preallocate="off",
        parallel_threshold=1 << 40,
        max_bytes=900 * 1024,
        storage_options=s3.storage_options(slow_proxy.endpoint_url),
    )
    held = _cache(tmpfs, None, s3, ranged=False).open(f"s3://{BUCKET}/pinned.tar")
    filler = Filler(tmpfs / "filler")
    url = f"s3://{BUCKET}/new.tar"
    try:
        with pytest.raises(CacheFullError) as info:
            cache.fetch(url, progress=OnFirstBytes(filler.fill))
        err = info.value
        assert (err.needed, err.max_bytes, err.evictable) == (len(new), 900 * 1024, 0)
        assert (err.in_use, err.in_use_bytes) == (1, len(pinned))
        assert err.free < len(new) and "eviction pass" in str(err)
        assert s3.count("GET", BUCKET, "new.tar") == 1
        assert not _temp_files(cache) and not cache.contains(url)
        assert held.read() == pinned
    finally:
        held.close()
        filler.close()


@pytest.mark.parametrize("ranged", [False, True], ids=["single-stream", "ranged"])
def test_file_system_turning_read_only_mid_download_is_a_cache_dir_error(
    s3: S3Server, slow_proxy: FaultProxy, ext4: Path, ranged: bool
) -> None:
    _data, url = _one_object(s3, seed=6)
    cache = _cache(ext4, slow_proxy, s3, ranged)
    parts = PARTS if ranged else 1
    source = subprocess.run(
        ["findmnt", "-no", "SOURCE", str(ext4)], capture_output=True, text=True, check=True
    ).stdout.strip()
    trigger = Path("/sys/fs/ext4") / Path(source).name / "trigger_fs_error"

    def go_read_only() -> None:
        _wait_for_gets(s3, "a.tar", parts)
        trigger.write_text("shardcache test: disk error\n")  # errors=remount-ro: now read-only

    with pytest.raises(CacheDirError) as info:
        cache.fetch(url, progress=OnFirstBytes(go_read_only))
    err = info.value
    assert err.errno == errno.EROFS and "Read-only file system" in str(err)
    assert err.url == url and "SHARDCACHE_DIR" in str(err) and "nothing was published" in str(err)
    assert s3.count("GET", BUCKET, "a.tar") == parts  # not retried as a remote error
    assert not cache.contains(url) and not cache.path_for(url).exists()
    # The temp file cannot be removed from a read-only file system: it is the only trace,
    # never at the final name, and `shardcache clean` sweeps it once the disk is writable.
    assert len(_temp_files(cache)) <= 1


@needs_root
def test_preallocate_auto_reserves_the_space_before_the_filler_can_take_it(
    s3: S3Server, slow_proxy: FaultProxy, tmpfs: Path
) -> None:
    """The contrast: on a local disk the default reserves the shard's full size first, so a
    concurrent filler that leaves only 64 KiB free (room for the metadata record, not for
    the rest of the shard) cannot take the download's space, and the download completes."""
    data, url = _one_object(s3, seed=7)
    cache = ShardCache(
        tmpfs / "cache",
        chunk_size=CHUNK,
        parallel_threshold=1 << 40,
        storage_options=s3.storage_options(slow_proxy.endpoint_url),
    )
    assert cache.settings.preallocate == "auto"
    filler = Filler(tmpfs / "filler", leave=64 * 1024)

    def fill() -> None:
        filler.fill()
        slow_proxy.conn_rate = None

    try:
        path = cache.fetch(url, progress=OnFirstBytes(fill))
        assert filler.filled and _sha(path.read_bytes()) == _sha(data)
        assert s3.count("GET", BUCKET, "a.tar") == 1
    finally:
        filler.close()


def test_preallocate_setting_is_validated_and_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert Settings.resolve(env={"SHARDCACHE_PREALLOCATE": " OFF "}).preallocate == "off"
    assert Settings.resolve(env={}).preallocate == "auto"
    with pytest.raises(ConfigError) as info:
        Settings.resolve(env={"SHARDCACHE_PREALLOCATE": "sometimes"})
    assert "SHARDCACHE_PREALLOCATE" in str(info.value) and "auto, off" in str(info.value)
    with pytest.raises(ConfigError):
        ShardCache(tmp_path / "cache", preallocate="always")
    monkeypatch.setenv("SHARDCACHE_PREALLOCATE", "off")
    assert main(["config"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("preallocate"))
    assert "off" in line and "env SHARDCACHE_PREALLOCATE" in line


def _iterate_webdataset(s3: S3Server, root: Path) -> CacheDirError:
    """The error of iterating a ``shardcache.WebDataset`` of 3 shards cached under ``root``,
    with a handler that would skip every failed shard: a cache directory problem is not a
    shard's, so it is raised, once, before any request reaches the store."""
    import webdataset as wds

    import shardcache

    s3.put_objects(BUCKET, {f"s-{i}.tar": _blob(2048, i) for i in range(3)})
    s3.clear_requests()
    urls = [f"s3://{BUCKET}/s-{i}.tar" for i in range(3)]
    dataset = shardcache.WebDataset(
        urls, handler=wds.warn_and_continue, shardshuffle=False, cache=ShardCache(root)
    )
    with pytest.raises(CacheDirError) as info:
        list(dataset)
    assert s3.count(None, BUCKET) == 0  # reported before any download
    assert "NFS" not in str(info.value)
    return info.value


@needs_root
def test_a_full_cache_disk_is_one_cache_dir_error_before_any_download(
    s3: S3Server, tmpfs: Path
) -> None:
    (tmpfs / "cache").mkdir()
    filler = os.open(tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: the disk is full
            while True:
                os.write(filler, b"\0" * PAGE)
    finally:
        os.close(filler)
    error = _iterate_webdataset(s3, tmpfs / "cache")
    assert error.errno == errno.ENOSPC and "no space or quota left" in str(error)
    assert "Free space there (shardcache evict" in str(error)


@needs_root
def test_a_read_only_cache_disk_is_one_cache_dir_error_before_any_download(
    s3: S3Server, mount_point: Callable[[list[str]], Path]
) -> None:
    read_only = mount_point(["-t", "tmpfs", "-o", "size=1m,ro", "tmpfs"])
    error = _iterate_webdataset(s3, read_only / "cache")
    assert error.errno == errno.EROFS and "read-only file system at" in str(error)
    assert "The file system is read-only" in str(error)


def test_a_cache_dir_a_local_file_system_refuses_fails_in_a_second_not_30(s3: S3Server) -> None:
    error = _iterate_webdataset(s3, Path("/proc/shardcache-cannot-be-here"))
    # "Not yet" is retried for 1 s on a local file system: about 10 tries of a backoff that
    # doubles from 5 ms to 1 s. 30 s would take over 25; a slower machine takes fewer.
    assert 2 <= error.attempts < 20, error
    assert error.errno == errno.ENOENT and "the file system (proc at /proc" in str(error)
