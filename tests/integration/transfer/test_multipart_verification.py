"""Objects as real buckets hold them, against a real moto server behind the fault proxy:
multipart uploads verified by their parts (the ETag's MD5 of the parts' MD5s, a composite
checksum), a byte flipped in transit in any part refused, encrypted objects whose ETag is
no MD5 fetched by what the store does promise, and the strict setting."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
from multipart_uploads import regular_sizes, upload_in_parts

from shardcache import IntegrityError, ShardCache, UnverifiableError
from shardcache._disk.layout import is_temp_name
from shardcache._disk.metadata import read_meta
from shardcache._ops.verify import verify

BUCKET = "mpv"
PART = 64 * 1024
SIZES = regular_sizes(5 * PART - 1000, PART)  # 5 parts, the last one short
NOT_AN_MD5 = '"0123456789abcdef0123456789abcdef"'


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def bucket(s3):
    s3.boto3_client().create_bucket(Bucket=BUCKET)
    return s3


def _plain_client(s3) -> Any:
    """A client that adds no checksum of its own: ETags only, as before S3's 2024-12 default."""
    return s3.boto3_client(request_checksum_calculation="when_required")


def _cache(tmp_path: Path, s3, *, parallel: bool, endpoint: str | None = None, **kw) -> ShardCache:
    kw.setdefault("retry_backoff", 0.01)
    kw.setdefault("part_size", PART)
    kw.setdefault("parallel_parts", 3)
    kw["parallel_threshold"] = 2 * PART if parallel else 1 << 30
    if endpoint is not None:
        kw["storage_options"] = s3.storage_options(endpoint)
    return ShardCache(tmp_path / ("parallel" if parallel else "stream"), **kw)


def _nothing_published(cache: ShardCache, url: str) -> bool:
    files = [p for p in cache.settings.scope_dir.rglob("*") if p.is_file()]
    return not cache.contains(url) and not [p for p in files if is_temp_name(p.name)]


@pytest.mark.parametrize("parallel", [False, True], ids=["stream", "parallel"])
def test_an_md5_multipart_object_is_verified_by_its_parts_md5s(
    bucket, tmp_path: Path, parallel: bool
) -> None:
    data = _blob(sum(SIZES), 1)
    answer = upload_in_parts(_plain_client(bucket), BUCKET, "mp.tar", data, SIZES)
    assert answer["ETag"].strip('"').endswith("-5")
    bucket.clear_requests()
    cache = _cache(tmp_path, bucket, parallel=parallel)
    path = cache.fetch(f"s3://{BUCKET}/mp.tar")
    assert path.read_bytes() == data
    record = read_meta(cache.layout, path)
    assert record["verified"] == "md5-parts"
    assert record["parts"] == [[PART, 4], [SIZES[-1], 1]]
    # The layout costs one HEAD (part 1: the sizes are regular); parallel parts are the
    # upload's own (the whole-object GET's body gives the first).
    assert bucket.count("HEAD", BUCKET, "mp.tar") == 1
    assert bucket.count("GET", BUCKET, "mp.tar") == (5 if parallel else 1)


@pytest.mark.parametrize("parallel", [False, True], ids=["stream", "parallel"])
@pytest.mark.parametrize("part", [0, 2, 4])
def test_a_byte_flipped_in_any_part_of_an_md5_multipart_object_is_refused(
    bucket, fault_proxy, tmp_path: Path, parallel: bool, part: int
) -> None:
    data = _blob(sum(SIZES), 2)
    upload_in_parts(_plain_client(bucket), BUCKET, "mp.tar", data, SIZES)
    url = f"s3://{BUCKET}/mp.tar"
    if parallel:  # a byte of the GET of that part (the first: the whole-object GET's)
        fault_proxy.add_fault(
            "corrupt",
            times=None,
            method="GET",
            path_contains="mp.tar",
            range_from=part * PART,
            corrupt_at=7,
        )
    else:  # a byte of that part in the one stream
        fault_proxy.add_fault(
            "corrupt", times=None, method="GET", path_contains="mp.tar", corrupt_at=part * PART + 7
        )
    cache = _cache(
        tmp_path, bucket, parallel=parallel, endpoint=fault_proxy.endpoint_url, retries=1
    )
    with pytest.raises(IntegrityError) as caught:
        cache.fetch(url)
    message = str(caught.value)
    assert url in message and "MD5 of the 5 parts' MD5s" in message and "the ETag" in message
    assert caught.value.algorithm == "md5-parts"
    assert fault_proxy.faults_injected("corrupt") == 2  # the retry policy applied
    assert _nothing_published(cache, url)


@pytest.mark.parametrize("algorithm", ["CRC32", "CRC32C", "SHA1", "SHA256"])
def test_a_composite_checksum_verifies_a_multipart_object_and_catches_a_flipped_byte(
    bucket, fault_proxy, tmp_path: Path, algorithm: str
) -> None:
    data = _blob(sum(SIZES), 3)
    client = bucket.boto3_client()
    upload_in_parts(client, BUCKET, "c.tar", data, SIZES, algorithm=algorithm)
    url = f"s3://{BUCKET}/c.tar"
    cache = _cache(tmp_path / "ok", bucket, parallel=True)
    record = read_meta(cache.layout, cache.fetch(url))
    assert record["verified"] == f"{algorithm.lower()}-parts"
    assert record["checksum"]["parts"] == 5

    fault_proxy.add_fault(
        "corrupt", times=None, method="GET", path_contains="c.tar", range_from=3 * PART
    )
    # No retry: a retry's fresh HEAD from moto carries the checksum without its "-N" (S3
    # sends it), so moto's object would be checked by the ETag's MD5 of MD5s instead.
    bad = _cache(
        tmp_path / "bad", bucket, parallel=True, endpoint=fault_proxy.endpoint_url, retries=0
    )
    with pytest.raises(IntegrityError) as caught:
        bad.fetch(url)
    assert f"{algorithm} of the 5 parts' {algorithm}s" in str(caught.value)
    assert f"x-amz-checksum-{algorithm.lower()}" in str(caught.value)
    assert _nothing_published(bad, url)


@pytest.mark.parametrize("parallel", [False, True], ids=["stream", "parallel"])
def test_parts_of_several_sizes_that_look_regular_are_learned_part_by_part(
    bucket, tmp_path: Path, parallel: bool
) -> None:
    """Part 1's size and the count fit a regular layout that is not the upload's: the
    mismatch asks for every part and hashes the file again before calling it corrupt."""
    sizes = [PART, PART // 2, PART + PART // 2, PART, 1000]
    data = _blob(sum(sizes), 4)
    upload_in_parts(_plain_client(bucket), BUCKET, "odd.tar", data, sizes)
    bucket.clear_requests()
    cache = _cache(tmp_path, bucket, parallel=parallel)
    path = cache.fetch(f"s3://{BUCKET}/odd.tar")
    assert path.read_bytes() == data
    record = read_meta(cache.layout, path)
    assert record["verified"] == "md5-parts"
    assert record["parts"] == [
        [PART, 1],
        [PART // 2, 1],
        [PART + PART // 2, 1],
        [PART, 1],
        [1000, 1],
    ]
    assert bucket.count("HEAD", BUCKET, "odd.tar") == 1 + len(sizes)


def test_parts_of_several_sizes_are_asked_for_up_front_and_fetched_as_they_are(
    bucket, tmp_path: Path
) -> None:
    sizes = [PART, 2 * PART, 2 * PART, 1000]  # 5 parts of part 1's size would not fit
    data = _blob(sum(sizes), 5)
    upload_in_parts(_plain_client(bucket), BUCKET, "odd.tar", data, sizes)
    bucket.clear_requests()
    cache = _cache(tmp_path, bucket, parallel=True)
    path = cache.fetch(f"s3://{BUCKET}/odd.tar")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["parts"] == [[PART, 1], [2 * PART, 2], [1000, 1]]
    assert bucket.count("HEAD", BUCKET, "odd.tar") == len(sizes)
    assert bucket.count("GET", BUCKET, "odd.tar") == len(sizes)  # one GET per upload part


@pytest.mark.parametrize(
    "encryption",
    [
        {"x-amz-server-side-encryption": "aws:kms:dsse"},
        {"x-amz-server-side-encryption": "aws:kms"},
        {"x-amz-server-side-encryption-customer-algorithm": "AES256"},
    ],
    ids=["dsse-kms", "sse-kms", "sse-c"],
)
def test_an_encrypted_object_whose_etag_is_no_md5_is_fetched_and_verified_by_its_size(
    bucket, fault_proxy, tmp_path: Path, encryption: dict[str, str]
) -> None:
    data = _blob(100_000, 6)
    _plain_client(bucket).put_object(Bucket=BUCKET, Key="enc.tar", Body=data)
    fault_proxy.add_fault(
        "headers",
        times=None,
        path_contains="enc.tar",
        set_headers={"ETag": NOT_AN_MD5} | encryption,
    )
    cache = _cache(tmp_path, bucket, parallel=False, endpoint=fault_proxy.endpoint_url)
    path = cache.fetch(f"s3://{BUCKET}/enc.tar")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["verified"] == "size"


def test_an_encrypted_object_with_a_checksum_is_verified_by_it(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    data = _blob(100_000, 7)
    bucket.boto3_client().put_object(
        Bucket=BUCKET, Key="enc.tar", Body=data, ChecksumAlgorithm="CRC32C"
    )
    fault_proxy.add_fault(
        "headers",
        times=None,
        path_contains="enc.tar",
        set_headers={"ETag": NOT_AN_MD5, "x-amz-server-side-encryption": "aws:kms:dsse"},
    )
    cache = _cache(tmp_path, bucket, parallel=False, endpoint=fault_proxy.endpoint_url)
    assert read_meta(cache.layout, cache.fetch(f"s3://{BUCKET}/enc.tar"))["verified"] == "crc32c"


def test_etag_md5_off_is_for_a_store_whose_etags_are_not_md5s(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    data = _blob(50_000, 9)
    _plain_client(bucket).put_object(Bucket=BUCKET, Key="o.tar", Body=data)
    fault_proxy.add_fault(
        "headers", times=None, path_contains="o.tar", set_headers={"ETag": NOT_AN_MD5}
    )
    url = f"s3://{BUCKET}/o.tar"
    default = _cache(tmp_path / "a", bucket, parallel=False, endpoint=fault_proxy.endpoint_url)
    with pytest.raises(IntegrityError, match="SHARDCACHE_ETAG_MD5=off"):
        default.fetch(url)
    off = _cache(
        tmp_path / "b", bucket, parallel=False, endpoint=fault_proxy.endpoint_url, etag_md5="off"
    )
    assert read_meta(off.layout, off.fetch(url))["verified"] == "size"


def test_strict_refuses_what_only_a_size_checks_and_accepts_a_checksum(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    _plain_client(bucket).put_object(Bucket=BUCKET, Key="bare.tar", Body=_blob(50_000, 10))
    bucket.boto3_client().put_object(
        Bucket=BUCKET, Key="summed.tar", Body=_blob(50_000, 11), ChecksumAlgorithm="CRC32"
    )
    fault_proxy.add_fault(
        "headers",
        times=None,
        path_contains="bare.tar",
        set_headers={"ETag": NOT_AN_MD5, "x-amz-server-side-encryption": "aws:kms"},
    )
    cache = _cache(
        tmp_path, bucket, parallel=False, endpoint=fault_proxy.endpoint_url, verify="strict"
    )
    url = f"s3://{BUCKET}/bare.tar"
    with pytest.raises(UnverifiableError) as caught:
        cache.fetch(url)
    assert url in str(caught.value) and "SHARDCACHE_VERIFY" in str(caught.value)
    assert _nothing_published(cache, url)
    assert read_meta(cache.layout, cache.fetch(f"s3://{BUCKET}/summed.tar"))["verified"] == "crc32"


def test_a_store_that_does_not_describe_the_parts_is_verified_by_size_and_says_so(
    bucket, fault_proxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = _blob(sum(SIZES), 12)
    upload_in_parts(_plain_client(bucket), BUCKET, "mp.tar", data, SIZES)
    fault_proxy.add_fault(
        "headers",
        times=None,
        method="HEAD",
        path_contains="mp.tar",
        set_headers={"x-amz-mp-parts-count": "9"},
    )
    cache = _cache(tmp_path, bucket, parallel=False, endpoint=fault_proxy.endpoint_url)
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        path = cache.fetch(f"s3://{BUCKET}/mp.tar")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["verified"] == "size"
    assert "does not describe the 5 parts" in caplog.text


def test_the_verify_command_checks_a_multipart_copy_over_its_recorded_parts(
    bucket, tmp_path: Path
) -> None:
    sizes = [PART, PART // 2, PART + PART // 2, PART, 1000]  # irregular: recorded, not guessed
    data = _blob(sum(sizes), 13)
    upload_in_parts(_plain_client(bucket), BUCKET, "mp.tar", data, sizes)
    cache = _cache(tmp_path, bucket, parallel=False)
    path = cache.fetch(f"s3://{BUCKET}/mp.tar")
    assert not verify(cache).failed
    damaged = bytearray(data)
    damaged[3 * PART] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(damaged))
    [bad] = verify(cache).of("bad")
    assert bad.detail.startswith("md5-parts ") and bad.removed


def test_the_verify_command_keeps_a_good_copy_whose_etag_is_no_md5(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    data = _blob(100_000, 14)
    _plain_client(bucket).put_object(Bucket=BUCKET, Key="enc.tar", Body=data)
    fault_proxy.add_fault(
        "headers",
        times=None,
        path_contains="enc.tar",
        set_headers={"ETag": NOT_AN_MD5, "x-amz-server-side-encryption": "aws:kms:dsse"},
    )
    cache = _cache(tmp_path, bucket, parallel=False, endpoint=fault_proxy.endpoint_url)
    cache.fetch(f"s3://{BUCKET}/enc.tar")
    report = verify(cache)
    assert not report.failed and len(report.of("ok")) == 1
