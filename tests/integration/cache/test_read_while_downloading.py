"""Reading a shard while it downloads (SHARDCACHE_READ_WHILE_DOWNLOADING), through a real
S3 server (moto; SeaweedFS too where marked) and a FaultProxy that holds back, cuts or
corrupts the body.

"Before the shard completed" is proven by counting, never by timing: the proxy holds the
second half of the body until the test releases it, so a sample that reaches the consumer
before the release came from the first half.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import webdataset as wds
from servers import on_s3_servers

import shardcache
from shardcache import IntegrityError, ShardCache, StallError
from shardcache._cache.shard_cache import Wiring
from shardcache._disk.layout import is_temp_name
from shardcache._disk.metadata import read_meta, write_meta
from shardcache._ops.demo import make_shard
from shardcache._store.growing import GrowingFile
from shardcache.testing import SeaweedS3Server
from shardcache.testing._service import upload_multipart

BUCKET = "early"
SAMPLES = 48
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shard(s3) -> tuple[str, bytes]:
    body = make_shard(0, SAMPLES)
    s3.put_objects(BUCKET, {"train-000000.tar": body})
    return f"s3://{BUCKET}/train-000000.tar", body


@pytest.fixture(autouse=True)
def _reading_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default; set here so that a machine's or CI's setting cannot turn it off."""
    monkeypatch.setenv("SHARDCACHE_READ_WHILE_DOWNLOADING", "on")


def _cache(tmp_path: Path, proxy, **overrides) -> ShardCache:
    options = {"endpoint_url": proxy.endpoint_url}
    overrides = {"retry_backoff": 0.01, "chunk_size": 16 << 10, **overrides}
    return ShardCache(tmp_path / "cache", storage_options=options, **overrides)


def _samples(cache: ShardCache, urls: list[str], **options):
    return iter(
        wds.DataPipeline(
            wds.SimpleShardList(urls),
            shardcache.tarfile_to_samples(cache=cache, threads=1, depth=1, **options),
            wds.to_tuple("__key__", "npy"),
        )
    )


def _expected(body: bytes, tmp_path: Path) -> list[tuple[str, bytes]]:
    """The samples of ``body`` as plain webdataset reads them from a local file."""
    local = tmp_path / "expected.tar"
    local.write_bytes(body)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList([str(local)]), wds.tarfile_to_samples(), wds.to_tuple("__key__", "npy")
    )
    return list(pipeline)


def _published(cache: ShardCache) -> list[Path]:
    return [e.path for e in cache.entries()]


def _temp_files(cache: ShardCache) -> list[str]:
    data = cache.layout.data_dir
    return [p.name for p in data.rglob("*") if p.is_file() and is_temp_name(p.name)]


@on_s3_servers
def test_first_sample_arrives_before_the_rest_of_the_shard_is_sent(
    shard, fault_proxy, tmp_path: Path
) -> None:
    url, body = shard
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=len(body) // 2)
    cache = _cache(tmp_path, fault_proxy, stall_timeout=60)
    samples = _samples(cache, [url])
    first = next(samples)
    # The proxy still holds the second half: the sample came from the first half, while
    # nothing was published yet.
    assert not hold.released.is_set()
    assert fault_proxy.faults_injected("hold") == 1
    assert _published(cache) == [] and not cache.contains(url)
    hold.release()
    got = [first, *samples]
    assert got == _expected(body, tmp_path)  # byte-identical to the verified path
    assert cache.contains(url) and cache.path_for(url).read_bytes() == body
    assert _temp_files(cache) == []


def test_opt_out_waits_for_the_verified_file(shard, fault_proxy, tmp_path: Path) -> None:
    url, body = shard
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=len(body) // 2)
    cache = _cache(tmp_path, fault_proxy, read_while_downloading="off")

    def release_once_held() -> None:
        fault_proxy.wait_for_faults(1, "hold", timeout=30)
        hold.release()

    releaser = threading.Thread(target=release_once_held)
    releaser.start()
    samples = _samples(cache, [url])
    first = next(samples)
    releaser.join(30)
    # The first sample came only once the whole body was sent, verified and published.
    assert hold.released.is_set() and cache.contains(url)
    assert [first, *samples] == _expected(body, tmp_path)


def test_the_setting_is_validated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDCACHE_READ_WHILE_DOWNLOADING", "sometimes")
    with pytest.raises(shardcache.ConfigError, match="SHARDCACHE_READ_WHILE_DOWNLOADING"):
        ShardCache(tmp_path / "cache")
    monkeypatch.setenv("SHARDCACHE_READ_WHILE_DOWNLOADING", "off")
    assert ShardCache(tmp_path / "cache").settings.read_while_downloading == "off"


@pytest.mark.parametrize("retries", [0, 2])
def test_a_corrupted_body_reaches_the_handler_as_integrity_error(
    shard, fault_proxy, tmp_path: Path, retries: int
) -> None:
    """The reader consumed bytes that then failed the MD5 check: IntegrityError through the
    handler. Without retries nothing is published; with them the next, correct download
    may be published (never the corrupted bytes), and the reader still gets the error.

    The proxy holds the second half (corrupted near its end) until a sample was read, so
    the reader is ahead of the verdict by construction, not by the download's pace."""
    url, body = shard
    hold = fault_proxy.add_fault(
        "hold", times=1, method="GET", truncate_bytes=len(body) // 2, corrupt_at=len(body) - 100
    )
    # botocore's own response checksum (moto sends CRC32) off: shardcache's MD5 judges.
    options = {
        "endpoint_url": fault_proxy.endpoint_url,
        "config_kwargs": {"response_checksum_validation": "when_required"},
    }
    cache = ShardCache(
        tmp_path / "cache",
        storage_options=options,
        retries=retries,
        retry_backoff=0.01,
        chunk_size=16 << 10,
    )
    seen: list[BaseException] = []

    def handler(exn: BaseException) -> bool:
        seen.append(exn)
        return True

    samples = _samples(cache, [url], handler=handler)
    got = [next(samples)]  # from the first half: the proxy still holds the rest
    assert not hold.released.is_set() and not seen
    hold.release()
    got += samples
    assert fault_proxy.faults_injected("hold") == 1
    # webdataset's tar expansion may pass a stream's error to the handler once per level
    # (member, then shard): every call is this shard's IntegrityError.
    assert seen and all(isinstance(e, IntegrityError) and e.url == url for e in seen), seen
    assert len(got) <= SAMPLES  # the first sample was read before the verdict
    if retries == 0:
        assert _published(cache) == []
    # With retries the download started again (and the stage, done, cancelled it or it
    # was published): never the corrupted bytes.
    assert all(path.read_bytes() == body for path in _published(cache))
    with cache.open(url) as f:
        assert f.read() == body
    assert _temp_files(cache) == []


def test_a_body_cut_mid_shard_resumes_and_the_reader_sees_correct_bytes(
    s3, shard, fault_proxy, tmp_path: Path
) -> None:
    url, body = shard
    fault_proxy.add_fault("truncate", times=1, method="GET", truncate_bytes=len(body) // 3)
    cache = _cache(tmp_path, fault_proxy)
    got = list(_samples(cache, [url]))
    assert fault_proxy.faults_injected("truncate") == 1
    assert s3.count("GET", BUCKET, "train-000000.tar") == 2  # the cut GET and the resume
    assert got == _expected(body, tmp_path)
    assert cache.path_for(url).read_bytes() == body


@pytest.mark.parametrize("handler", [wds.reraise_exception, wds.ignore_and_continue])
def test_a_stalled_download_raises_stall_error_while_reading(
    shard, fault_proxy, tmp_path: Path, handler
) -> None:
    url, body = shard
    cache = _cache(tmp_path, fault_proxy, io_timeout=60, retries=0)
    cache.remote.info(url)  # the S3 client warmed up: the stall is the held body's alone
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=len(body) // 2)
    samples = _samples(cache, [url], stall_timeout=3.0, handler=handler)
    try:
        first = next(samples)
        assert not hold.released.is_set()
        with pytest.raises(StallError) as info:
            for _ in samples:
                pass
        assert info.value.url == url
        assert first in _expected(body, tmp_path)
    finally:
        hold.release()
    assert _published(cache) == []


@on_s3_servers
def test_open_reads_while_downloading_and_pins_the_shard(
    shard, fault_proxy, tmp_path: Path
) -> None:
    url, body = shard
    half = len(body) // 2
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=half)
    cache = _cache(tmp_path, fault_proxy, max_bytes=10 << 20)
    with cache.open(url) as f:
        head = f.read(4096)
        assert not hold.released.is_set() and not cache.contains(url)
        hold.release()
        rest = f.read()
        assert head + rest == body
        # Published now, and pinned by this reader: neither remove nor evict takes it.
        path = cache.path_for(url)
        assert path.read_bytes() == body
        assert not cache.remove(path)
        report = cache.evict(0)
        assert report.in_use == 1 and path.exists()
    assert cache.remove(path)


@on_s3_servers
def test_a_multipart_object_is_read_while_downloading_and_published_verified_by_its_parts(
    s3, fault_proxy, tmp_path: Path
) -> None:
    """The verdict on an upload's MD5 of MD5s comes with its last byte: the reader reads
    the first bytes while the proxy holds the rest."""
    unit = 5 << 20 if isinstance(s3, SeaweedS3Server) else 64 << 10
    body = os.urandom(2 * unit + 1000)
    client = s3.boto3_client(request_checksum_calculation="when_required")
    client.create_bucket(Bucket=BUCKET)
    upload_multipart(client, BUCKET, "mp.tar", body, unit)
    url = f"s3://{BUCKET}/mp.tar"
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=unit // 2)
    cache = _cache(tmp_path, fault_proxy, parallel_threshold=1 << 30)
    with cache.open(url) as f:
        head = f.read(4096)
        assert not hold.released.is_set() and not cache.contains(url)
        hold.release()
        assert head + f.read() == body
    assert read_meta(cache.layout, cache.path_for(url))["verified"] == "md5-parts"


def test_eviction_while_a_stage_streams_a_shard(shard, fault_proxy, tmp_path: Path) -> None:
    url, body = shard
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=len(body) // 2)
    cache = _cache(tmp_path, fault_proxy, max_bytes=10 << 20)
    samples = _samples(cache, [url])
    first = next(samples)
    hold.release()
    got = [first]
    while not cache.contains(url):  # bounded: the shard has SAMPLES samples
        got.append(next(samples))
    assert cache.evict(0).in_use == 1  # the stage's reader pins it
    got.extend(samples)
    assert got == _expected(body, tmp_path)
    assert cache.evict(0).in_use == 0 and not cache.contains(url)


def test_sigkill_of_the_downloading_reader_leaves_no_visible_partial_file(
    shard, fault_proxy, tmp_path: Path
) -> None:
    url, body = shard
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=len(body) // 2)
    script = textwrap.dedent(
        """
        import sys
        from shardcache import ShardCache
        cache = ShardCache(sys.argv[1], storage_options={"endpoint_url": sys.argv[3]},
                           chunk_size=16384)
        f = cache.open(sys.argv[2])
        print(len(f.read(4096)), flush=True)
        sys.stdin.read()  # killed here, mid-download, holding the stream open
        """
    )
    cache_dir = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(cache_dir), url, fault_proxy.endpoint_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"4096"  # it read from the in-flight file
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        hold.release()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    cache = ShardCache(cache_dir, storage_options={"endpoint_url": fault_proxy.endpoint_url})
    assert not cache.contains(url) and _published(cache) == []
    assert len(_temp_files(cache)) == 1  # only the dead writer's .part, swept by `clean`
    with cache.open(url) as f:  # a new reader downloads it again, correctly
        assert f.read() == body


def test_a_parallel_ranged_download_is_read_only_once_published(
    shard, fault_proxy, tmp_path: Path
) -> None:
    """Parts land out of order, written past the early reader's writer: such a download
    is never offered early; the consumer gets the verified file."""
    url, body = shard
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=1000)
    cache = _cache(
        tmp_path, fault_proxy, parallel_threshold=64 << 10, part_size=64 << 10, parallel_parts=4
    )

    def release_once_held() -> None:
        fault_proxy.wait_for_faults(1, "hold", timeout=30)
        hold.release()

    releaser = threading.Thread(target=release_once_held)
    releaser.start()
    with cache.prefetch_streaming([url], threads=1, depth=1) as shards:
        shard_, early, _until_stall = shards.next_early()
        releaser.join(30)
        assert early is None and cache.contains(url)
        assert shard_.path.read_bytes() == body


def _growing(tmp_path: Path) -> tuple[GrowingFile, list[GrowingFile], int]:
    fd = os.open(tmp_path / "x.part", os.O_RDWR | os.O_CREAT, 0o600)
    offered: list[GrowingFile] = []
    return GrowingFile(fd, tmp_path / "x", "s3://b/x", offered.append), offered, fd


def _no_stall() -> float:
    return 5.0


def test_a_reader_sees_only_the_contiguous_prefix_and_the_verdict(tmp_path: Path) -> None:
    growing, offered, fd = _growing(tmp_path)
    out = growing.writer()
    os.pwrite(fd, b"z" * 10, 100)  # past the prefix (as a ranged part would): not readable
    growing.wrote(100, 10)
    assert offered == []
    out.write(b"a" * 50)
    assert offered == [growing] and growing.claim()
    reader = growing.open(_no_stall)
    assert reader.read1(1000) == b"a" * 50  # the prefix, not the bytes at 100
    out.write(b"b" * 50)  # up to the part at 100: the watermark stays contiguous
    growing.published(110)
    assert reader.read() == b"b" * 50 + b"z" * 10
    assert growing.verdict(_no_stall) is None
    reader.close()
    os.close(fd)


def test_a_reader_seeks_ahead_of_the_download_and_waits_there(tmp_path: Path) -> None:
    """A resumed epoch seeks to a sample's offset in a shard still downloading."""
    growing, _offered, fd = _growing(tmp_path)
    out = growing.writer()
    out.write(b"a" * 50)
    assert growing.claim()
    deadline = [time.monotonic() + 0.2]

    def until_stall() -> float:  # as the prefetcher's watchdog: a bounded wait, then a verdict
        remaining = deadline[0] - time.monotonic()
        if remaining <= 0:
            raise StallError("no bytes at 70")
        return remaining

    reader = growing.open(until_stall)
    reader.seek(70)
    with pytest.raises(StallError):  # nothing at 70 yet: the wait is bounded
        reader.read(5)
    deadline[0] = time.monotonic() + 30
    out.write(b"b" * 30)
    assert reader.read(5) == b"b" * 5 and reader.tell() == 75
    reader.seek(-30, os.SEEK_CUR)
    assert reader.read(10) == b"a" * 5 + b"b" * 5
    with pytest.raises(io.UnsupportedOperation, match="cannot seek from the end"):
        reader.seek(0, os.SEEK_END)
    growing.published(80)
    assert reader.read() == b"b" * 25
    reader.close()
    os.close(fd)


def test_bytes_rewritten_after_they_were_read_raise_integrity_error(tmp_path: Path) -> None:
    growing, _offered, fd = _growing(tmp_path)
    out = growing.writer()
    out.write(b"a" * 50)
    assert growing.claim()
    reader = growing.open(_no_stall)
    assert reader.read1(1000) == b"a" * 50
    out.seek(0)  # a download started again from byte 0 (failed verification)
    out.truncate()
    out.write(b"c" * 50)
    growing.published(50)  # the new attempt is published: the reader still gets the error
    with pytest.raises(IntegrityError, match="started again from byte 0"):
        reader.read()
    assert growing.verdict(_no_stall) is None  # raised once, by the reader
    reader.close()
    os.close(fd)


def _reading_ten_bytes(tmp_path: Path):
    """A claimed download with 10 bytes written, and its reader, which read them."""
    growing, _offered, fd = _growing(tmp_path)
    growing.writer().write(b"a" * 10)
    assert growing.claim()
    reader = growing.open(_no_stall)
    assert reader.read1(100) == b"a" * 10
    return growing, reader, fd


def test_a_failed_download_reaches_its_reader(tmp_path: Path) -> None:
    growing, reader, fd = _reading_ten_bytes(tmp_path)
    growing.failed(OSError(28, "No space left on device"))
    with pytest.raises(shardcache.FetchError, match="No space left"):
        reader.read()
    reader.close()
    os.close(fd)


def _published_copy(tmp_path: Path, data: bytes) -> int:
    """A published shard's pinned descriptor, as the cache hands it to ``resumed``."""
    path = tmp_path / "published"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def _fds_under(root: Path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{root}/")
        except OSError:
            continue
    return count


@pytest.mark.parametrize("read_before_stop", [50, 20], ids=["all-written", "some-written"])
def test_a_stopped_download_goes_on_in_the_published_file(
    tmp_path: Path, read_before_stop: int
) -> None:
    growing, _offered, fd = _growing(tmp_path)
    out = growing.writer()
    out.write(b"a" * read_before_stop)
    assert growing.claim()
    reader = growing.open(_no_stall)
    assert reader.read(read_before_stop) == b"a" * read_before_stop
    out.write(b"a" * (50 - read_before_stop))  # written, not read yet
    growing.stopped(FileNotFoundError(2, "No such file or directory"))  # its directory went
    os.close(fd)  # the writer's descriptor closes as the attempt ends
    assert growing.waits_for_resume() and not growing.claim()
    # The shard fetched again: the same first 30 bytes, then bytes the stopped attempt
    # wrote differently (never given to this reader when it read only 20).
    fresh = b"a" * 30 + b"b" * 70
    if read_before_stop == 20:
        growing.resumed(_published_copy(tmp_path, fresh))
        assert reader.read() == fresh[20:]
        assert growing.verdict(_no_stall) is None
    else:  # it had read 50 bytes: 20 of them differ from the verified shard
        growing.resumed(_published_copy(tmp_path, fresh))
        with pytest.raises(IntegrityError, match="differs from it at byte 30"):
            reader.read()
    reader.close()
    assert _fds_under(tmp_path) == 0  # the stopped attempt's and the published descriptors


def test_a_stopped_download_whose_fetch_fails_gives_its_reader_the_fetch_error(
    tmp_path: Path,
) -> None:
    growing, reader, fd = _reading_ten_bytes(tmp_path)
    growing.stopped(FileNotFoundError(2, "No such file or directory"))
    os.close(fd)
    growing.failed(shardcache.CacheDirError("the cache's files kept disappearing"))
    with pytest.raises(shardcache.CacheDirError, match="kept disappearing"):
        reader.read()
    reader.close()
    assert _fds_under(tmp_path) == 0


def test_a_stopped_download_nobody_claimed_cannot_be_claimed(tmp_path: Path) -> None:
    growing, offered, fd = _growing(tmp_path)
    growing.writer().write(b"a" * 10)
    assert offered == [growing]
    growing.stopped(OSError(28, "No space left on device"))
    os.close(fd)
    assert not growing.claim() and not growing.waits_for_resume()
    assert _fds_under(tmp_path) == 0  # its pin was let go


@pytest.mark.parametrize("way", ["stage", "open"])
@pytest.mark.parametrize("removal", ["once", "again-and-again"])
def test_directories_removed_under_a_reader_mid_download(
    s3, shard, fault_proxy, tmp_path: Path, way: str, removal: str
) -> None:
    """A tmp cleaner removes the cache's directories while a reader follows the in-flight
    file. Once: the verified bytes are published from the open descriptor (one GET).
    Again and again (the metadata directory gone at each of write_meta's three tries):
    that attempt stops, the cache fetches the shard again, and the reader goes on in the
    published file. Either way the reader gets the source's bytes."""
    url, body = shard
    hold = fault_proxy.add_fault("hold", times=1, method="GET", truncate_bytes=len(body) // 2)
    cache = _cache(tmp_path, fault_proxy, max_bytes=10 << 20)
    if removal == "again-and-again":
        calls = []

        def failing_once(layout, final, record) -> None:
            calls.append(final)
            if len(calls) == 1:  # what write_meta raises after its third vanished try
                raise FileNotFoundError(2, "No such file or directory", str(final))
            write_meta(layout, final, record)

        cache = ShardCache._wired(cache.settings, Wiring(write_meta=failing_once))
    if way == "stage":
        samples = _samples(cache, [url])
        got = [next(samples)]
    else:
        stream = cache.open(url)
        head = stream.read(4096)
    assert not hold.released.is_set()  # read from the first half of the first GET
    shutil.rmtree(cache.settings.scope_dir)  # the .part's directory with it
    hold.release()
    if way == "stage":
        got.extend(samples)
        assert got == _expected(body, tmp_path)
    else:
        with stream:
            assert head + stream.read() == body
    gets = 2 if removal == "again-and-again" else 1  # the stopped GET and one more
    assert s3.count("GET", BUCKET, "train-000000.tar") == gets
    assert cache.contains(url) and cache.path_for(url).read_bytes() == body
    assert _temp_files(cache) == []
