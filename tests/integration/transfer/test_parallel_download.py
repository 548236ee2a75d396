"""Parallel ranged GETs of large S3 objects (small thresholds so the objects stay small)."""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path

import pytest
from servers import on_s3_servers

from shardcache import PermanentFetchError, ShardCache
from shardcache._disk.layout import is_temp_name
from shardcache._disk.metadata import read_meta

BUCKET = "shards"
PART = 64 * 1024


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _cache(tmp_path: Path, **kw) -> ShardCache:
    kw.setdefault("retry_backoff", 0.01)
    kw.setdefault("parallel_threshold", 2 * PART)
    kw.setdefault("part_size", PART)
    kw.setdefault("parallel_parts", 3)
    return ShardCache(tmp_path / "cache", **kw)


def _leftovers(cache: ShardCache) -> list[Path]:
    return [p for p in cache.settings.scope_dir.rglob("*") if p.is_file() and is_temp_name(p.name)]


def test_large_object_is_fetched_with_ranged_gets(s3, tmp_path: Path) -> None:
    data = _blob(5 * PART + 1234, 1)  # 6 parts, the last one short
    s3.put_objects(BUCKET, {"big.tar": data})
    cache = _cache(tmp_path)
    seen: list[tuple[str, int]] = []
    path = cache.fetch(
        f"s3://{BUCKET}/big.tar",
        progress=lambda *, phase, bytes_done, bytes_total: seen.append((phase, bytes_done)),
    )
    assert path.read_bytes() == data
    # One GET per part: the whole-object GET's body gives the first, no HEAD.
    assert (s3.count("GET", BUCKET, "big.tar"), s3.count("HEAD", BUCKET, "big.tar")) == (6, 0)
    assert seen[-1][1] == len(data)
    # Checked against the object's CRC32 (what botocore's upload asks moto to keep), combined
    # from the parts' CRCs as they arrived: no pass over the file after the download.
    assert read_meta(cache.layout, path)["verified"] == "crc32"
    assert not any(phase == "verifying" for phase, _ in seen)
    assert not _leftovers(cache)
    assert cache.fetch(f"s3://{BUCKET}/big.tar") == path
    assert s3.count("GET", BUCKET, "big.tar") == 6


def test_a_corrupted_part_fails_the_combined_checksum_and_the_object_comes_again(
    s3, fault_proxy, tmp_path: Path
) -> None:
    """A byte of the first part inverted in transit: the parts' combined CRC32 differs from
    the object's, nothing is published, and the object is downloaded again (fresh metadata,
    every part ranged) and published intact."""
    data = _blob(4 * PART, 7)
    s3.put_objects(BUCKET, {"bad.tar": data})
    s3.clear_requests()
    fault_proxy.add_fault("corrupt", times=1, method="GET", path_contains="bad.tar", corrupt_at=10)
    cache = _cache(tmp_path, storage_options=s3.storage_options(fault_proxy.endpoint_url))
    path = cache.fetch(f"s3://{BUCKET}/bad.tar")
    assert path.read_bytes() == data and fault_proxy.faults_injected("corrupt") == 1
    assert read_meta(cache.layout, path)["verified"] == "crc32"
    # 4 GETs a download; the second starts with fresh metadata (one HEAD).
    assert (s3.count("GET", BUCKET, "bad.tar"), s3.count("HEAD", BUCKET, "bad.tar")) == (8, 1)
    assert not _leftovers(cache)


class _Stop(BaseException):
    """What a prefetcher's progress callback raises to cancel a download."""


@pytest.mark.parametrize("phase", ["downloading", "verifying"])
def test_a_cancelled_md5_download_leaves_no_hashing_thread(s3, tmp_path: Path, phase: str) -> None:
    """An object without an S3 checksum (verified by its ETag's MD5, hashed in order by a
    follower thread while the parts arrive): a download cancelled from its progress callback
    (as the prefetcher cancels) stops that thread before the error leaves the fetch."""
    data = _blob(6 * PART, 8)
    s3.put_objects(BUCKET, {})  # the bucket
    plain = s3.boto3_client(request_checksum_calculation="when_required")
    plain.put_object(Bucket=BUCKET, Key="plain.tar", Body=data)  # an MD5 ETag, no checksum
    cache = _cache(tmp_path)
    url = f"s3://{BUCKET}/plain.tar"

    def cancel(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        if phase == stop_at:
            raise _Stop

    stop_at = phase
    with pytest.raises(_Stop):
        cache.fetch(url, progress=cancel)
    assert not [t for t in threading.enumerate() if t.name == "shardcache-hash"]
    assert not cache.contains(url) and not _leftovers(cache)
    path = cache.fetch(url)
    assert path.read_bytes() == data and read_meta(cache.layout, path)["verified"] == "md5"


def test_small_object_keeps_the_single_stream(s3, tmp_path: Path) -> None:
    data = _blob(PART + 10, 2)
    s3.put_objects(BUCKET, {"small.tar": data})
    cache = _cache(tmp_path)
    assert cache.fetch(f"s3://{BUCKET}/small.tar").read_bytes() == data
    assert s3.count("GET", BUCKET, "small.tar") == 1


def test_multipart_object_is_fetched_in_its_parts_and_verified_by_their_md5s(
    s3, tmp_path: Path
) -> None:
    data = _blob(4 * PART, 3)
    s3.put_objects(BUCKET, {"mp.tar": data}, multipart_chunk=PART)
    cache = _cache(tmp_path)
    path = cache.fetch(f"s3://{BUCKET}/mp.tar")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["verified"] == "md5-parts"
    assert s3.count("GET", BUCKET, "mp.tar") == 4


@pytest.mark.parametrize("fault", ["status:503", "truncate", "reset"])
def test_a_failed_part_is_retried_alone(s3, fault_proxy, tmp_path: Path, fault: str) -> None:
    data = _blob(4 * PART, 4)
    s3.put_objects(BUCKET, {"big.tar": data})
    s3.clear_requests()
    # A truncation within the first 1000 bytes of whichever GET it meets: always inside the
    # part that GET serves (the whole-object GET's body serves only the first part).
    fault_proxy.add_fault(
        fault, times=1, method="GET", path_contains="big.tar", truncate_bytes=1000
    )
    cache = _cache(tmp_path, storage_options=s3.storage_options(fault_proxy.endpoint_url))
    assert cache.fetch(f"s3://{BUCKET}/big.tar").read_bytes() == data
    assert fault_proxy.faults_injected(fault) == 1
    gets = s3.count("GET", BUCKET, "big.tar")
    # 4 parts; a 503 or reset never reaches the server, a truncated part resumes.
    assert gets == (5 if fault == "truncate" else 4)
    assert not _leftovers(cache)


def test_a_permanently_failing_part_publishes_nothing(s3, fault_proxy, tmp_path: Path) -> None:
    data = _blob(4 * PART, 5)
    s3.put_objects(BUCKET, {"big.tar": data})
    fault_proxy.add_fault("status:403", times=1, method="GET", path_contains="big.tar")
    cache = _cache(tmp_path, storage_options=s3.storage_options(fault_proxy.endpoint_url))
    url = f"s3://{BUCKET}/big.tar"
    with pytest.raises(PermanentFetchError):
        cache.fetch(url)
    assert not cache.contains(url)
    assert not cache.path_for(url).exists()
    assert not _leftovers(cache)
    assert cache.fetch(url).read_bytes() == data  # and a later fetch works


def test_parts_that_keep_failing_give_up_with_nothing_published(
    s3, fault_proxy, tmp_path: Path
) -> None:
    # 500, not 503: a SlowDown would also cut the process's request rate down to a slot
    # every few seconds by the last attempt (test_throttle.py covers that).
    s3.put_objects(BUCKET, {"big.tar": _blob(4 * PART, 6)})
    fault_proxy.add_fault("status:500", times=None, method="GET", path_contains="big.tar")
    cache = _cache(
        tmp_path, retries=2, storage_options=s3.storage_options(fault_proxy.endpoint_url)
    )
    url = f"s3://{BUCKET}/big.tar"
    with pytest.raises(Exception, match="3 attempts"):
        cache.fetch(url)
    assert not cache.path_for(url).exists()
    assert not _leftovers(cache)


@on_s3_servers
def test_an_object_replaced_mid_download_is_fetched_again_never_torn(s3, tmp_path: Path) -> None:
    """The object is replaced by another of the same size once its GET answered and before
    any ranged GET is sent: those carry If-Match on the first ETag, the store refuses them
    (412) and the download starts over on the new object. With SHARDCACHE_VERIFY=size nothing
    else would tell the first part of the old object followed by the new one's rest."""
    rng = random.Random("replaced")
    old, new = rng.randbytes(4 * PART), rng.randbytes(4 * PART)
    s3.put_objects(BUCKET, {"replaced.tar": old})
    replaced: list[str] = []

    def replace_once(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        # Called in the fetching thread before the parts are sent (the first GET answered).
        if phase == "downloading" and not replaced:
            replaced.append(s3.put_objects(BUCKET, {"replaced.tar": new})["replaced.tar"])

    cache = _cache(tmp_path, verify="size")
    path = cache.fetch(f"s3://{BUCKET}/replaced.tar", progress=replace_once)
    assert replaced == [hashlib.md5(new).hexdigest()]
    assert path.read_bytes() == new, "the copy mixes the old and the new object"
    assert read_meta(cache.layout, path)["etag"] == replaced[0]
    assert not _leftovers(cache)


@on_s3_servers
def test_an_object_replaced_before_a_stream_resumes_is_fetched_again_never_torn(
    s3, fault_proxy, tmp_path: Path
) -> None:
    """One stream, cut after 1000 bytes; the object is replaced before the retry: the
    retry's GET carries If-Match on the first ETag, the store refuses it (412) and the
    download starts over on the new object (it was a PermanentFetchError)."""
    rng = random.Random("resumed")
    old, new = rng.randbytes(4 * PART), rng.randbytes(4 * PART)
    s3.put_objects(BUCKET, {"resumed.tar": old})
    fault_proxy.add_fault(
        "truncate", times=1, method="GET", path_contains="resumed.tar", truncate_bytes=1000
    )
    replaced: list[str] = []

    def replace_at_the_retry(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        if phase == "retry 1" and not replaced:
            replaced.append(s3.put_objects(BUCKET, {"resumed.tar": new})["resumed.tar"])

    cache = _cache(
        tmp_path,
        verify="size",
        parallel_threshold=1 << 30,
        storage_options=s3.storage_options(fault_proxy.endpoint_url),
    )
    path = cache.fetch(f"s3://{BUCKET}/resumed.tar", progress=replace_at_the_retry)
    assert replaced and fault_proxy.faults_injected("truncate") == 1
    assert path.read_bytes() == new, "the copy mixes the old and the new object"
    assert read_meta(cache.layout, path)["etag"] == replaced[0]
    assert not _leftovers(cache)
