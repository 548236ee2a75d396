"""Verification against S3's additional checksums (CRC64NVME, CRC32C, CRC32, SHA1, SHA256),
with the ETag's MD5 only where the object has none, against a real moto server."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import botocore.session
import pytest

from shardcache import IntegrityError, ShardCache
from shardcache._disk.layout import is_temp_name
from shardcache._disk.metadata import read_meta
from shardcache._ops.verify import verify
from shardcache._transfer.checksums import S3_ALGORITHMS, Hasher, from_s3_head
from shardcache.testing._service import upload_multipart

S3_ALGORITHMS_OF_BOTOCORE = set(
    botocore.session.get_session().get_service_model("s3").shape_for("ChecksumAlgorithm").enum
)
BUCKET = "sums"
PART = 64 * 1024


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _cache(tmp_path: Path, endpoint_url: str | None = None, **kw: Any) -> ShardCache:
    kw.setdefault("retry_backoff", 0.01)
    if endpoint_url is not None:
        kw["storage_options"] = {"endpoint_url": endpoint_url}
    return ShardCache(tmp_path / "cache", **kw)


def _put(s3, key: str, data: bytes, algorithm: str | None) -> None:
    """One PUT with ``algorithm``'s checksum, or with none at all (``None``)."""
    if algorithm is None:  # botocore adds a CRC32 by default; this client adds nothing
        client = s3.boto3_client(request_checksum_calculation="when_required")
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
    else:
        s3.boto3_client().put_object(Bucket=BUCKET, Key=key, Body=data, ChecksumAlgorithm=algorithm)


def _nothing_published(cache: ShardCache, url: str) -> bool:
    files = [p for p in cache.settings.scope_dir.rglob("*") if p.is_file()]
    return not cache.contains(url) and not [p for p in files if is_temp_name(p.name)]


@pytest.fixture
def bucket(s3):
    s3.boto3_client().create_bucket(Bucket=BUCKET)
    return s3


def _newer(algorithm: str) -> Any:
    """S3's newer checksums, which older botocore releases (the lowest-versions pass) and
    awscrt releases before 0.32 (xxHash) do not know."""
    known = algorithm in S3_ALGORITHMS_OF_BOTOCORE and algorithm.lower() in S3_ALGORITHMS
    reason = f"this botocore or awscrt does not know {algorithm} checksums"
    return pytest.param(algorithm, marks=pytest.mark.skipif(not known, reason=reason))


@pytest.mark.parametrize(
    "algorithm",
    [
        "CRC64NVME",
        "CRC32C",
        "CRC32",
        "SHA1",
        "SHA256",
        *(_newer(a) for a in ("XXHASH64", "XXHASH3", "XXHASH128", "SHA512")),
    ],
)
def test_a_download_is_verified_with_the_objects_checksum_and_records_it(
    bucket, tmp_path: Path, algorithm: str
) -> None:
    data = _blob(300_000, 1)
    _put(bucket, "a.tar", data, algorithm)
    cache = _cache(tmp_path)
    path = cache.fetch(f"s3://{BUCKET}/a.tar")
    assert path.read_bytes() == data
    record = read_meta(cache.layout, path)
    assert record["verified"] == algorithm.lower()
    expected = Hasher(algorithm.lower())
    expected.update(data)
    assert record["checksum"] == {"algorithm": algorithm.lower(), "value": expected.value()}
    assert record["md5"]  # the ETag's MD5 is still recorded, only not recomputed


def test_an_object_without_a_checksum_is_verified_by_the_etags_md5(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    data = _blob(200_000, 2)
    _put(bucket, "plain.tar", data, None)
    url = f"s3://{BUCKET}/plain.tar"
    cache = _cache(tmp_path)
    record = read_meta(cache.layout, cache.fetch(url))
    assert record["verified"] == "md5" and record["checksum"] is None

    fault_proxy.add_fault("corrupt", times=None, method="GET", path_contains="plain.tar")
    proxied = _cache(tmp_path / "p", fault_proxy.endpoint_url, retries=1)
    with pytest.raises(IntegrityError) as info:
        proxied.fetch(url)
    assert "MD5" in str(info.value) and "the ETag" in str(info.value)
    assert _nothing_published(proxied, url)


@pytest.mark.parametrize("algorithm", ["CRC64NVME", "CRC32C", "CRC32"])
def test_a_corrupted_body_fails_the_crc_and_nothing_is_published(
    bucket, fault_proxy, tmp_path: Path, algorithm: str
) -> None:
    data = _blob(300_000, 3)
    _put(bucket, "c.tar", data, algorithm)
    url = f"s3://{BUCKET}/c.tar"
    fault_proxy.add_fault("corrupt", times=None, method="GET", path_contains="c.tar")
    cache = _cache(tmp_path, fault_proxy.endpoint_url, retries=1)
    with pytest.raises(IntegrityError) as info:
        cache.fetch(url)
    message = str(info.value)
    assert f"{algorithm} of the downloaded bytes" in message
    assert f"x-amz-checksum-{algorithm.lower()}" in message and url in message
    assert info.value.attempts == 2  # downloaded again from byte 0 once, then reported
    assert fault_proxy.faults_injected("corrupt") == 2
    assert _nothing_published(cache, url)


def test_one_corrupted_body_is_downloaded_again_and_then_verified(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    data = _blob(300_000, 4)
    _put(bucket, "once.tar", data, "CRC64NVME")
    fault_proxy.add_fault("corrupt", times=1, method="GET", path_contains="once.tar")
    cache = _cache(tmp_path, fault_proxy.endpoint_url, retries=1)
    path = cache.fetch(f"s3://{BUCKET}/once.tar")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["verified"] == "crc64nvme"
    assert fault_proxy.faults_injected("corrupt") == 1


def test_a_corrupted_part_of_a_parallel_download_fails_the_crc(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    data = _blob(5 * PART + 77, 5)
    _put(bucket, "big.tar", data, "CRC32C")
    url = f"s3://{BUCKET}/big.tar"
    parallel = {"parallel_threshold": 2 * PART, "part_size": PART, "parallel_parts": 3}
    fault_proxy.add_fault("corrupt", times=None, method="GET", path_contains="big.tar")
    cache = _cache(tmp_path, fault_proxy.endpoint_url, retries=1, **parallel)
    with pytest.raises(IntegrityError) as info:
        cache.fetch(url)
    assert "CRC32C of the downloaded bytes" in str(info.value)
    assert _nothing_published(cache, url)

    fault_proxy.clear_faults()
    good = cache.fetch(url)
    assert good.read_bytes() == data
    assert read_meta(cache.layout, good)["verified"] == "crc32c"


def test_a_full_object_checksum_of_a_multipart_upload_is_used(bucket, tmp_path: Path) -> None:
    data = _blob(11 << 20, 6)
    upload_multipart(
        bucket.boto3_client(),
        BUCKET,
        "mp.tar",
        data,
        5 << 20,
        checksum="CRC64NVME",
        checksum_type="FULL_OBJECT",
    )
    cache = _cache(tmp_path)
    path = cache.fetch(f"s3://{BUCKET}/mp.tar")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["verified"] == "crc64nvme"


def test_verify_size_checks_no_checksum(bucket, fault_proxy, tmp_path: Path) -> None:
    data = _blob(100_000, 8)
    _put(bucket, "s.tar", data, "CRC32C")
    cache = _cache(tmp_path, verify="size")
    assert read_meta(cache.layout, cache.fetch(f"s3://{BUCKET}/s.tar"))["verified"] == "size"


def test_the_verify_command_checks_a_multipart_copy_with_the_crc(bucket, tmp_path: Path) -> None:
    """A multipart object's full-object CRC (what a download checks, cheaper than its MD5 of
    MD5s) catches an altered copy that the size alone would not."""
    data = _blob(11 << 20, 9)
    upload_multipart(
        bucket.boto3_client(),
        BUCKET,
        "v.tar",
        data,
        5 << 20,
        checksum="CRC64NVME",
        checksum_type="FULL_OBJECT",
    )
    cache = _cache(tmp_path)
    path = cache.fetch(f"s3://{BUCKET}/v.tar")
    assert not verify(cache).failed
    damaged = bytearray(data)
    damaged[500] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(damaged))
    report = verify(cache)
    [bad] = report.of("bad")
    assert bad.detail.startswith("crc64nvme ") and bad.removed


@pytest.mark.parametrize(
    ("head", "multipart", "want"),
    [
        ({"ChecksumCRC32C": "abc="}, False, ("crc32c", "abc=", None)),
        ({"ChecksumCRC32C": "abc=", "ChecksumType": "COMPOSITE"}, False, None),
        ({"ChecksumCRC32C": "abc=-3"}, False, ("crc32c", "abc=", 3)),
        ({"ChecksumSHA256": "abc=-3", "ChecksumType": "COMPOSITE"}, True, ("sha256", "abc=", 3)),
        ({"ChecksumCRC32C": "abc="}, True, None),  # multipart of unknown type: composite
        (
            {"ChecksumCRC64NVME": "abc=", "ChecksumType": "FULL_OBJECT"},
            True,
            ("crc64nvme", "abc=", None),
        ),
        (
            {"ChecksumMD5": "1B2M2Y8AsgTpgAmY7PhCfg=="},
            False,
            ("md5", "d41d8cd98f00b204e9800998ecf8427e", None),
        ),
        ({}, False, None),
    ],
)
def test_a_heads_checksum_is_of_the_bytes_or_of_the_parts_never_of_unknown_kind(
    head: dict, multipart: bool, want: tuple[str, str, int | None] | None
) -> None:
    got = from_s3_head(head, multipart_etag=multipart)
    assert (got.algorithm, got.value, got.parts) == want if want else got is None
