"""ShardCache against a real moto S3 server (own process) reached by s3fs over HTTP."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import ssl
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from processes import TOGETHER_TIMEOUT, run_together
from servers import on_s3_servers

from shardcache import (
    CacheDirError,
    IntegrityError,
    PermanentFetchError,
    RemoteNotFoundError,
    ShardCache,
    TransientFetchError,
)
from shardcache._base import writeback
from shardcache._disk.layout import CacheLayout, is_temp_name
from shardcache._store.shard_ids import ShardIds

BUCKET = "shards"
CTX = mp.get_context("spawn")


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "data").rglob("*") if p.is_file())


@pytest.fixture
def shards(s3):
    objects = {f"train-{i:06d}.tar": _blob(300_000 + i * 1000, i) for i in range(6)}
    s3.put_objects(BUCKET, objects)
    return {f"s3://{BUCKET}/{k}": v for k, v in objects.items()}


def _cache(tmp_path: Path, **kw) -> ShardCache:
    kw.setdefault("retry_backoff", 0.01)
    return ShardCache(tmp_path / "cache", **kw)


def test_fetch_publishes_a_verified_private_copy_once(s3, shards, tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    url, data = next(iter(shards.items()))
    assert not cache.contains(url)
    path = cache.fetch(url)
    assert path.read_bytes() == data
    assert path == cache.path_for(url) and cache.contains(url)
    assert path.is_relative_to(cache.settings.scope_dir)
    assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0, (
        "cache files must not be writable by others"
    )
    assert cache.fetch(url) == path
    with cache.open(url) as f:
        assert f.read() == data
    key = url.split("/", 3)[3]
    assert s3.count("GET", BUCKET, key) == 1
    stats = cache.stats()
    assert (stats.misses, stats.hits, stats.errors) == (1, 2, 0)
    assert stats.bytes_downloaded == len(data)
    assert not [p for p in _files(cache.settings.scope_dir) if is_temp_name(p.name)]


def test_multipart_object_is_verified_by_size(s3, tmp_path: Path) -> None:
    data = _blob(12 << 20, 99)
    s3.put_objects(BUCKET, {"big.tar": data}, multipart_chunk=5 << 20)
    cache = _cache(tmp_path)
    assert cache.fetch(f"s3://{BUCKET}/big.tar").read_bytes() == data


def test_same_key_on_two_endpoints_never_collides(s3, tmp_path: Path) -> None:
    a = _cache(tmp_path, storage_options={"endpoint_url": "http://127.0.0.1:1"})
    b = _cache(tmp_path, storage_options={"endpoint_url": "http://127.0.0.1:2"})
    assert a.path_for("s3://b/k.tar") != b.path_for("s3://b/k.tar")


def test_a_fetch_computes_the_shards_identity_once(s3, shards, tmp_path: Path) -> None:
    """One identity computed per URL however often it is fetched (miss, hit, open,
    prefetch) while it is remembered, and the storage options resolved once per cache
    however many shards it fetches."""
    cache = _cache(tmp_path)
    ids = cache._ids
    urls = list(shards)
    cache.fetch(urls[0])  # a miss: hit check, lock, re-check, metadata, publish
    assert ids.computed == 1
    cache.fetch(urls[0])  # a hit
    with cache.open(urls[0]):
        pass
    assert ids.computed == 1
    with cache.prefetch(urls[1:4], threads=2) as shards_ahead:
        assert [url for url, _path in shards_ahead] == urls[1:4]
    assert ids.computed == 4
    assert cache.contains(urls[3]) and cache.contains(urls[0])
    assert ids.computed == 4
    options = cache.remote.storage_options_for("s3")
    assert cache.remote.storage_options_for("s3") is options  # resolved once, then kept
    assert cache.stats().misses == 4


def test_the_remembered_identities_are_bounded(tmp_path: Path) -> None:
    """The ``memo`` most recent URLs are remembered, the oldest forgotten first (and computed
    again when asked for); each protocol's store is resolved once."""
    resolved: list[str] = []

    def storage_options_for(protocol: str) -> dict:
        resolved.append(protocol)
        return {}

    ids = ShardIds(CacheLayout(tmp_path / "scope"), storage_options_for, memo=3)
    urls = [f"s3://{BUCKET}/train-{i:06d}.tar" for i in range(4)]
    first = [ids.identify(url) for url in urls]
    assert ids.computed == 4
    assert [ids.identify(url) for url in urls[1:]] == first[1:]  # remembered
    assert ids.computed == 4
    assert ids.identify(urls[0]) == first[0]  # the oldest of four: forgotten, computed again
    assert ids.computed == 5
    assert resolved == ["s3"]


def test_a_relative_local_path_is_identified_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard.tar").write_bytes(name.encode() * 100)
    cache = _cache(tmp_path)
    monkeypatch.chdir(tmp_path / "a")
    assert cache.fetch("shard.tar").read_bytes() == b"a" * 100
    monkeypatch.chdir(tmp_path / "b")
    assert cache.fetch("shard.tar").read_bytes() == b"b" * 100


def _race_worker(cache_dir: str, urls: list[str], seed: int, lock_mode: str, start, out) -> None:
    cache = ShardCache(cache_dir, scope="node", lock_mode=lock_mode)
    order = list(urls)
    random.Random(seed).shuffle(order)
    start.wait()  # all processes begin fetching together
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = dict(zip(order, pool.map(cache.fetch, order), strict=True))
    digests = {url: _sha(path.read_bytes()) for url, path in paths.items()}
    out.put((digests, cache.stats().as_dict()))


@pytest.mark.parametrize(
    ("s3", "lock_mode"),
    [("moto", "flock"), ("moto", "lease"), ("seaweedfs", "flock")],
    indirect=["s3"],
)
@pytest.mark.timeout(TOGETHER_TIMEOUT)
def test_eight_processes_race_and_each_shard_is_downloaded_once(
    s3, fault_proxy, shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock_mode: str
) -> None:
    """The processes reach the server through the proxy, which counts every request."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint_url)
    cache_dir = tmp_path / "shared"
    results = run_together(
        _race_worker, [(str(cache_dir), list(shards), seed, lock_mode) for seed in range(8)]
    )
    expected = {url: _sha(data) for url, data in shards.items()}
    assert all(digests == expected for digests, _ in results)
    assert sum(stats["misses"] for _, stats in results) == len(shards)
    assert sum(s["misses"] + s["shared"] + s["hits"] for _, s in results) == 8 * len(shards)
    assert fault_proxy.requests_seen() == {("GET", url.removeprefix("s3:/")): 1 for url in shards}
    leftovers = [p for p in _files(cache_dir / "node") if is_temp_name(p.name)]
    assert not leftovers


def _fetch_through(endpoint: str, cache_dir: str, url: str) -> None:
    ShardCache(cache_dir, storage_options={"endpoint_url": endpoint}).fetch(url)


def test_sigkilled_downloader_is_recovered_and_leaves_nothing_visible(
    s3, fault_proxy, shards, tmp_path: Path
) -> None:
    url, data = next(iter(shards.items()))
    cache_dir = tmp_path / "cache"
    # Headers and half the body, the rest never: the holder is mid-download, its .part
    # written (it is made once the GET's headers gave the size).
    fault_proxy.add_fault("hold", times=1, method="GET", path_contains="train-000000")
    holder = CTX.Process(
        target=_fetch_through, args=(fault_proxy.endpoint_url, str(cache_dir), url)
    )
    holder.start()
    try:
        # The dead holder's lock record is never judged stuck before the wait gives up
        # (30 s): a fetch that succeeds got the lock from the kernel, not a timeout.
        cache = ShardCache(
            cache_dir,
            storage_options={"endpoint_url": fault_proxy.endpoint_url},
            lock_timeout=30,
            lock_stuck_after=3600,
            lease_time=3600,
        )

        def part_files() -> list[Path]:
            return [p for p in _files(cache.settings.scope_dir) if is_temp_name(p.name)]

        deadline = time.monotonic() + 60
        while not part_files() and holder.is_alive() and time.monotonic() < deadline:
            holder.join(0.05)  # bounded wait for the holder's download to be held mid-body
        assert fault_proxy.stats().injected, "the holder never reached its download"
        assert part_files(), "the holder should be mid-download with a .part file"
        assert not cache.contains(url)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
    assert cache.fetch(url).read_bytes() == data
    stats = cache.stats()
    assert (stats.misses, stats.shared, stats.errors) == (1, 0, 0), stats
    # The dead writer's temp file is never at the final name and is not mistaken for data.
    finals = [p for p in _files(cache.settings.scope_dir) if not is_temp_name(p.name)]
    assert [p.read_bytes() for p in finals] == [data]


@on_s3_servers
def test_transient_faults_are_retried_to_success(s3, fault_proxy, shards, tmp_path: Path) -> None:
    url, data = next(iter(shards.items()))
    for kind in ("status:503", "reset", "truncate", "status:500"):
        fault_proxy.add_fault(kind, times=1, method="GET", path_contains="train-000000")
    cache = _cache(tmp_path, storage_options={"endpoint_url": fault_proxy.endpoint_url}, retries=6)
    assert cache.fetch(url).read_bytes() == data
    assert len(fault_proxy.stats().injected) == 4


def test_exhausted_retries_name_url_attempts_and_cause(s3, fault_proxy, shards, tmp_path) -> None:
    url = next(iter(shards))
    fault_proxy.add_fault("status:500", times=50, method="GET", path_contains="train-000000")
    cache = _cache(tmp_path, storage_options={"endpoint_url": fault_proxy.endpoint_url}, retries=2)
    with pytest.raises(TransientFetchError) as info:
        cache.fetch(url)
    exc = info.value
    assert exc.url == url and exc.attempts == 3
    assert url in str(exc) and "3 attempts" in str(exc) and "500" in str(exc)
    assert "SHARDCACHE_RETRIES" in str(exc)
    assert not _files(cache.settings.scope_dir), "a failed download leaves nothing behind"


def test_slowdown_refusals_are_retried_without_using_up_the_retries(
    s3, fault_proxy, shards, tmp_path
) -> None:
    """With no retries at all, three SlowDowns in a row are waited out (the process's
    throttle slows it down meanwhile); with SHARDCACHE_SLOWDOWN_RETRY_TIME=0 the first
    one is the one attempt."""
    url, data = next(iter(shards.items()))
    options = {"endpoint_url": fault_proxy.endpoint_url}
    fault_proxy.add_fault("status:503", times=3, method="GET", path_contains="train-000000")
    patient = _cache(tmp_path / "patient", storage_options=options, retries=0)
    assert patient.fetch(url).read_bytes() == data
    assert fault_proxy.faults_injected("status:503") == 3

    fault_proxy.add_fault("status:503", times=None, method="GET", path_contains="train-000000")
    counted = _cache(
        tmp_path / "counted", storage_options=options, retries=1, slowdown_retry_time=0
    )
    with pytest.raises(TransientFetchError) as info:
        counted.fetch(url)
    assert info.value.attempts == 2 and fault_proxy.faults_injected("status:503") == 5
    message = str(info.value)
    assert "refusing them for its request rate" in message and "SlowDown" in message
    for hint in ("SHARDCACHE_SLOWDOWN_RETRY_TIME", "SHARDCACHE_JOB_REQUEST_RATE"):
        assert hint in message
    assert not _files(counted.settings.scope_dir), "a failed download leaves nothing behind"


def test_missing_key_fails_fast_without_retries(s3, shards, tmp_path: Path) -> None:
    cache = _cache(tmp_path, retries=5, retry_backoff=5.0)
    url = f"s3://{BUCKET}/no-such-shard.tar"
    with pytest.raises(RemoteNotFoundError) as info:
        cache.fetch(url)
    assert isinstance(info.value, FileNotFoundError)
    assert url in str(info.value) and "does not exist" in str(info.value)
    assert info.value.attempts == 1
    assert s3.count("GET", BUCKET, "no-such-shard.tar") == 1  # one request, no HEAD
    assert s3.count("HEAD", BUCKET, "no-such-shard.tar") == 0


def test_open_of_missing_key_costs_one_request_and_one_error(s3, shards, tmp_path: Path) -> None:
    cache = _cache(tmp_path, retries=5, retry_backoff=5.0)
    url = f"s3://{BUCKET}/no-such-shard.tar"
    with pytest.raises(RemoteNotFoundError) as info:
        cache.open(url)
    assert info.value.attempts == 1
    assert s3.count(None, BUCKET, "no-such-shard.tar") == 1
    assert cache.stats().errors == 1


def test_missing_bucket_fails_fast(s3, tmp_path: Path) -> None:
    with pytest.raises(RemoteNotFoundError, match="no-such-bucket"):
        _cache(tmp_path, retry_backoff=5.0).fetch("s3://no-such-bucket/x.tar")


def test_access_denied_is_permanent(s3, fault_proxy, shards, tmp_path: Path) -> None:
    url = next(iter(shards))
    fault_proxy.add_fault("status:403", times=10, path_contains="train-000000")
    cache = _cache(tmp_path, storage_options={"endpoint_url": fault_proxy.endpoint_url}, retries=5)
    with pytest.raises(PermissionError) as info:  # the built-in family, and ours
        cache.fetch(url)
    assert isinstance(info.value, PermanentFetchError)
    assert "403" in str(info.value) and "without retries" in str(info.value)
    assert len(fault_proxy.stats().injected) == 1


def test_corruption_in_transit_is_detected_and_never_published(
    s3, fault_proxy, shards, tmp_path: Path
) -> None:
    """Every GET of the shard has one byte inverted in transit (the proxy): the first
    download and the one retry from byte 0 fail verification; nothing is published."""
    url = next(iter(shards))
    fault_proxy.add_fault("corrupt", times=None, method="GET", path_contains=url.rsplit("/")[-1])
    cache = _cache(tmp_path, storage_options={"endpoint_url": fault_proxy.endpoint_url}, retries=1)
    with pytest.raises(IntegrityError) as info:
        cache.fetch(url)
    algorithm = info.value.details["algorithm"]
    assert f"{algorithm.upper()} of the downloaded bytes" in str(info.value), info.value
    assert url in str(info.value) and "nothing was published" in str(info.value)
    assert info.value.attempts == 2  # retried once from byte 0, then reported
    assert len(fault_proxy.stats().injected) == 2
    assert not cache.contains(url) and not _files(cache.settings.scope_dir)


def test_cache_dir_that_is_a_file_is_a_clear_error(s3, shards, tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    with pytest.raises(CacheDirError) as info:
        ShardCache(blocker).fetch(next(iter(shards)))
    assert str(blocker) in str(info.value)


def test_every_thread_uses_one_s3_client_and_caches_share_service_models(
    s3, tmp_path: Path
) -> None:
    s3.put_objects(BUCKET, {f"c-{i}.tar": _blob(1000, i) for i in range(6)})
    urls = [f"s3://{BUCKET}/c-{i}.tar" for i in range(6)]
    cache = ShardCache(tmp_path / "a")
    seen = [cache.remote.filesystem(urls[0])[0]]
    cache.remote.info(urls[0])  # the client is made here (botocore then edits its options)

    def fetch(url: str) -> None:
        cache.fetch(url)
        seen.append(cache.remote.filesystem(url)[0])

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(fetch, urls[:3]))
    with cache.prefetch(urls[3:], threads=3) as shards:
        assert len(list(shards)) == 3
    seen.append(cache.remote.filesystem(urls[0])[0])
    assert len({id(fs) for fs in seen}) == 1, "one file system (one client) for all threads"
    fs = seen[0]
    assert fs.storage_options["config_kwargs"]["max_pool_connections"] >= 10
    other = ShardCache(tmp_path / "b", io_timeout=33)  # other options: another client...
    other.fetch(urls[0])
    other_fs = other.remote.filesystem(urls[0])[0]
    assert other_fs is not fs
    loader = fs.session.get_component("data_loader")
    assert other_fs.session.get_component("data_loader") is loader  # ...parses no model again


def test_a_client_of_a_plain_http_endpoint_loads_no_certificates(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over ``http://`` the certificate bundle is never read (it is aiobotocore's first-request
    cost); a user who asks for verification gets it loaded, and both fetch the same bytes."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    loads: list[object] = []
    load = ssl.SSLContext.load_verify_locations

    def counted(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(args or kwargs)
        load(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    data = _blob(50_000, 3)
    s3.put_objects(BUCKET, {"plain.tar": data})
    url = f"s3://{BUCKET}/plain.tar"
    plain = _cache(tmp_path / "plain", storage_options=s3.storage_options())
    assert plain.fetch(url).read_bytes() == data
    assert loads == []
    options = s3.storage_options()
    options["client_kwargs"]["verify"] = True
    verified = _cache(tmp_path / "verified", storage_options=options)
    assert verified.fetch(url).read_bytes() == data
    assert loads, "verify=True: the certificates are loaded as botocore would"


@pytest.mark.parametrize("parallel", [False, True], ids=["one stream", "parallel parts"])
def test_a_download_starts_its_write_back_before_the_fsync(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    """Every few MiB of a download, its temp file's write-back to disk is started, so the
    fsync before publishing waits only for the rest; the bytes are the same."""
    real = writeback._sync_file_range
    if real is None:
        pytest.skip("this C library has no sync_file_range")
    started: list[int] = []

    def recorded(fd: int, *args: int) -> int:
        started.append(fd)
        return real(fd, *args)

    monkeypatch.setattr(writeback, "_sync_file_range", recorded)
    data = _blob(20 << 20, 5)
    s3.put_objects(BUCKET, {"wb.tar": data})
    sizes = {"parallel_threshold": 4 << 20, "part_size": 4 << 20} if parallel else {}
    cache = _cache(tmp_path, **sizes)
    assert cache.fetch(f"s3://{BUCKET}/wb.tar").read_bytes() == data
    assert len(started) >= 1  # 20 MiB: at 8 and 16 MiB (the parts' progress: when reported)
