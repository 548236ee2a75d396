"""Objects as real buckets hold them, against real servers (moto, and SeaweedFS, a
production object store) behind the fault proxy: multipart uploads verified by their parts
(the ETag's MD5 of the parts' MD5s, a composite checksum), a byte flipped in transit in
any part refused, encrypted objects whose ETag is no MD5 fetched by what the store does
promise, and the strict setting."""

from __future__ import annotations

import base64
import logging
import os
import random
import zlib
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest
from servers import on_s3_servers

from shardcache import IntegrityError, ShardCache, UnverifiableError
from shardcache._disk.layout import is_temp_name
from shardcache._disk.metadata import read_meta
from shardcache._ops.verify import verify
from shardcache.testing import FaultProxy, SeaweedS3Server
from shardcache.testing._service import upload_multipart

BUCKET = "mpv"
NOT_AN_MD5 = '"0123456789abcdef0123456789abcdef"'


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _unit(s3) -> int:
    """The part size of the tests' uploads: SeaweedFS refuses parts under 5 MiB but the
    last; moto is told to take small ones."""
    return 5 << 20 if isinstance(s3, SeaweedS3Server) else 64 << 10


def _sizes(s3) -> list[int]:
    """Three parts, the last one short."""
    unit = _unit(s3)
    return [unit, unit, unit // 3]


@pytest.fixture
def bucket(s3):
    s3.boto3_client().create_bucket(Bucket=BUCKET)
    return s3


def _plain_client(s3) -> Any:
    """A client that adds no checksum of its own: ETags only, as before S3's 2024-12 default."""
    return s3.boto3_client(request_checksum_calculation="when_required")


def _cache(tmp_path: Path, s3, proxy: FaultProxy, *, parallel: bool, **kw) -> ShardCache:
    kw.setdefault("retry_backoff", 0.01)
    kw.setdefault("part_size", _unit(s3))
    kw.setdefault("parallel_parts", 3)
    kw["parallel_threshold"] = 2 * _unit(s3) if parallel else 1 << 30
    kw["storage_options"] = s3.storage_options(proxy.endpoint_url)
    return ShardCache(tmp_path / ("parallel" if parallel else "stream"), **kw)


def _etag_not_an_md5(proxy: FaultProxy, key: str, **headers: str) -> None:
    """Every answer about ``key`` carries an ETag that is not its MD5, and ``headers``: an
    object as an encrypting or another S3-compatible store describes it."""
    proxy.add_fault(
        "headers", times=None, path_contains=key, set_headers={"ETag": NOT_AN_MD5} | headers
    )


def _requests(proxy: FaultProxy, method: str, key: str) -> int:
    return sum(n for (m, path), n in proxy.requests_seen().items() if m == method and key in path)


def _nothing_published(cache: ShardCache, url: str) -> bool:
    files = [p for p in cache.settings.scope_dir.rglob("*") if p.is_file()]
    return not cache.contains(url) and not [p for p in files if is_temp_name(p.name)]


@on_s3_servers
@pytest.mark.parametrize("parallel", [False, True], ids=["stream", "parallel"])
def test_an_md5_multipart_object_is_verified_by_its_parts_md5s(
    bucket, fault_proxy, tmp_path: Path, parallel: bool
) -> None:
    sizes = _sizes(bucket)
    data = _blob(sum(sizes), 1)
    answer = upload_multipart(_plain_client(bucket), BUCKET, "mp.tar", data, sizes)
    assert answer["ETag"].strip('"').endswith("-3")
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=parallel)
    path = cache.fetch(f"s3://{BUCKET}/mp.tar")
    assert path.read_bytes() == data
    record = read_meta(cache.layout, path)
    assert record["verified"] == "md5-parts"
    assert record["parts"] == [[sizes[0], 2], [sizes[-1], 1]]
    # The layout costs one HEAD (part 1: the sizes are regular); parallel parts are the
    # upload's own (the whole-object GET's body gives the first).
    assert _requests(fault_proxy, "HEAD", "mp.tar") == 1
    assert _requests(fault_proxy, "GET", "mp.tar") == (3 if parallel else 1)


@on_s3_servers
@pytest.mark.parametrize("parallel", [False, True], ids=["stream", "parallel"])
@pytest.mark.parametrize("part", [0, 1, 2], ids=["first", "middle", "last"])
def test_a_byte_flipped_in_any_part_of_an_md5_multipart_object_is_refused(
    bucket, fault_proxy, tmp_path: Path, parallel: bool, part: int
) -> None:
    sizes = _sizes(bucket)
    data = _blob(sum(sizes), 2)
    upload_multipart(_plain_client(bucket), BUCKET, "mp.tar", data, sizes)
    url = f"s3://{BUCKET}/mp.tar"
    start = sum(sizes[:part])
    if parallel:  # a byte of the GET of that part (the first: the whole-object GET's)
        fault_proxy.add_fault(
            "corrupt",
            times=None,
            method="GET",
            path_contains="mp.tar",
            range_from=start,
            corrupt_at=7,
        )
    else:  # a byte of that part in the one stream
        fault_proxy.add_fault(
            "corrupt", times=None, method="GET", path_contains="mp.tar", corrupt_at=start + 7
        )
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=parallel, retries=1)
    with pytest.raises(IntegrityError) as caught:
        cache.fetch(url)
    message = str(caught.value)
    assert url in message and "MD5 of the 3 parts' MD5s" in message and "the ETag" in message
    assert caught.value.algorithm == "md5-parts"
    assert fault_proxy.faults_injected("corrupt") == 2  # the retry policy applied
    assert _nothing_published(cache, url)


@pytest.mark.parametrize(
    ("s3", "algorithm"),
    [("moto", a) for a in ("CRC32", "CRC32C", "SHA1", "SHA256")]
    + [("seaweedfs", a) for a in ("CRC32", "CRC32C", "SHA256")],
    indirect=["s3"],
)
def test_a_composite_checksum_verifies_a_multipart_object_and_catches_a_flipped_byte(
    bucket, fault_proxy, tmp_path: Path, algorithm: str
) -> None:
    sizes = _sizes(bucket)
    data = _blob(sum(sizes), 3)
    upload_multipart(
        bucket.boto3_client(),
        BUCKET,
        "c.tar",
        data,
        sizes,
        checksum=algorithm,
        checksum_type="COMPOSITE",
    )
    url = f"s3://{BUCKET}/c.tar"
    cache = _cache(tmp_path / "ok", bucket, fault_proxy, parallel=True)
    record = read_meta(cache.layout, cache.fetch(url))
    assert record["verified"] == f"{algorithm.lower()}-parts"
    assert record["checksum"]["parts"] == 3

    fault_proxy.add_fault(
        "corrupt", times=None, method="GET", path_contains="c.tar", range_from=sizes[0]
    )
    # No retry: a retry's fresh HEAD from moto carries the checksum without its "-N" (S3
    # sends it), so moto's object would be checked by the ETag's MD5 of MD5s instead.
    bad = _cache(tmp_path / "bad", bucket, fault_proxy, parallel=True, retries=0)
    with pytest.raises(IntegrityError) as caught:
        bad.fetch(url)
    assert f"{algorithm} of the 3 parts' {algorithm}s" in str(caught.value)
    assert f"x-amz-checksum-{algorithm.lower()}" in str(caught.value)
    assert _nothing_published(bad, url)


@on_s3_servers
@pytest.mark.parametrize("parallel", [False, True], ids=["stream", "parallel"])
def test_parts_of_several_sizes_that_look_regular_are_learned_part_by_part(
    bucket, fault_proxy, tmp_path: Path, parallel: bool
) -> None:
    """Part 1's size and the count fit a regular layout that is not the upload's: the
    mismatch asks for every part and hashes the file again before calling it corrupt."""
    unit = _unit(bucket)
    sizes = [unit + unit // 2, unit, 2 * unit, unit + unit // 2, 1000]
    data = _blob(sum(sizes), 4)
    upload_multipart(_plain_client(bucket), BUCKET, "odd.tar", data, sizes)
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=parallel)
    path = cache.fetch(f"s3://{BUCKET}/odd.tar")
    assert path.read_bytes() == data
    record = read_meta(cache.layout, path)
    assert record["verified"] == "md5-parts"
    assert record["parts"] == [[size, 1] for size in sizes]
    assert _requests(fault_proxy, "HEAD", "odd.tar") == 1 + len(sizes)


@on_s3_servers
def test_parts_of_several_sizes_are_asked_for_up_front_and_fetched_as_they_are(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    unit = _unit(bucket)
    sizes = [unit, 2 * unit, 2 * unit, 1000]  # 6 parts of part 1's size would hold it, not 4
    data = _blob(sum(sizes), 5)
    upload_multipart(_plain_client(bucket), BUCKET, "odd.tar", data, sizes)
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=True)
    path = cache.fetch(f"s3://{BUCKET}/odd.tar")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["parts"] == [[unit, 1], [2 * unit, 2], [1000, 1]]
    assert _requests(fault_proxy, "HEAD", "odd.tar") == len(sizes)
    assert _requests(fault_proxy, "GET", "odd.tar") == len(sizes)  # one GET per upload part


def test_a_customer_key_object_on_seaweedfs_is_fetched_and_verified_by_what_it_has(
    seaweedfs, tmp_path: Path
) -> None:
    """SSE-C for real: the store decrypts with the key the reader sends; its ETag is not
    promised to be the content's MD5, its checksum is."""
    key = os.urandom(32)
    sse = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": key}
    client = seaweedfs.boto3_client()
    client.create_bucket(Bucket=BUCKET)
    bare, summed = _blob(100_000, 15), _blob(100_000, 16)
    _plain_client(seaweedfs).put_object(Bucket=BUCKET, Key="bare.tar", Body=bare, **sse)
    client.put_object(
        Bucket=BUCKET, Key="summed.tar", Body=summed, ChecksumAlgorithm="CRC32", **sse
    )
    options = seaweedfs.storage_options() | {"s3_additional_kwargs": sse}
    cache = ShardCache(tmp_path / "c", storage_options=options, retry_backoff=0.01)
    path = cache.fetch(f"s3://{BUCKET}/bare.tar")
    assert path.read_bytes() == bare
    assert read_meta(cache.layout, path)["verified"] == "size"
    path = cache.fetch(f"s3://{BUCKET}/summed.tar")
    assert path.read_bytes() == summed
    assert read_meta(cache.layout, path)["verified"] == "crc32"


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
    _etag_not_an_md5(fault_proxy, "enc.tar", **encryption)
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=False)
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
    _etag_not_an_md5(fault_proxy, "enc.tar", **{"x-amz-server-side-encryption": "aws:kms:dsse"})
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=False)
    assert read_meta(cache.layout, cache.fetch(f"s3://{BUCKET}/enc.tar"))["verified"] == "crc32c"


def test_etag_md5_off_is_for_a_store_whose_etags_are_not_md5s(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    data = _blob(50_000, 9)
    _plain_client(bucket).put_object(Bucket=BUCKET, Key="o.tar", Body=data)
    _etag_not_an_md5(fault_proxy, "o.tar")
    url = f"s3://{BUCKET}/o.tar"
    # No retry: its If-Match would carry the rewritten ETag, which the store refuses.
    default = _cache(tmp_path / "a", bucket, fault_proxy, parallel=False, retries=0)
    with pytest.raises(IntegrityError, match="SHARDCACHE_ETAG_MD5=off"):
        default.fetch(url)
    off = _cache(tmp_path / "b", bucket, fault_proxy, parallel=False, etag_md5="off")
    assert read_meta(off.layout, off.fetch(url))["verified"] == "size"


def test_strict_refuses_what_only_a_size_checks_and_accepts_a_checksum(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    _plain_client(bucket).put_object(Bucket=BUCKET, Key="bare.tar", Body=_blob(50_000, 10))
    bucket.boto3_client().put_object(
        Bucket=BUCKET, Key="summed.tar", Body=_blob(50_000, 11), ChecksumAlgorithm="CRC32"
    )
    _etag_not_an_md5(fault_proxy, "bare.tar", **{"x-amz-server-side-encryption": "aws:kms"})
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=False, verify="strict")
    url = f"s3://{BUCKET}/bare.tar"
    with pytest.raises(UnverifiableError) as caught:
        cache.fetch(url)
    assert url in str(caught.value) and "SHARDCACHE_VERIFY" in str(caught.value)
    assert _nothing_published(cache, url)
    assert read_meta(cache.layout, cache.fetch(f"s3://{BUCKET}/summed.tar"))["verified"] == "crc32"


def test_a_store_that_does_not_describe_the_parts_is_verified_by_size_and_says_so(
    bucket, fault_proxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sizes = _sizes(bucket)
    data = _blob(sum(sizes), 12)
    upload_multipart(_plain_client(bucket), BUCKET, "mp.tar", data, sizes)
    fault_proxy.add_fault(
        "headers",
        times=None,
        method="HEAD",
        path_contains="mp.tar",
        set_headers={"x-amz-mp-parts-count": "9"},
    )
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=False)
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        path = cache.fetch(f"s3://{BUCKET}/mp.tar")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["verified"] == "size"
    assert "does not describe the 3 parts" in caplog.text


def test_the_verify_command_checks_a_multipart_copy_over_its_recorded_parts(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    unit = _unit(bucket)
    sizes = [unit, unit // 2, unit + unit // 2, unit, 1000]  # irregular: recorded, not guessed
    data = _blob(sum(sizes), 13)
    upload_multipart(_plain_client(bucket), BUCKET, "mp.tar", data, sizes)
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=False)
    path = cache.fetch(f"s3://{BUCKET}/mp.tar")
    assert not verify(cache).failed
    damaged = bytearray(data)
    damaged[3 * unit] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(damaged))
    [bad] = verify(cache).of("bad")
    assert bad.detail.startswith("md5-parts ") and bad.removed


def test_the_verify_command_keeps_a_good_copy_whose_etag_is_no_md5(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    data = _blob(100_000, 14)
    _plain_client(bucket).put_object(Bucket=BUCKET, Key="enc.tar", Body=data)
    _etag_not_an_md5(fault_proxy, "enc.tar", **{"x-amz-server-side-encryption": "aws:kms:dsse"})
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=False)
    cache.fetch(f"s3://{BUCKET}/enc.tar")
    report = verify(cache)
    assert not report.failed and len(report.of("ok")) == 1


@pytest.mark.parametrize("parallel", [False, True], ids=["stream", "parallel"])
@pytest.mark.parametrize("per_part", [True, False], ids=["store-names-parts", "no-part-checksums"])
def test_a_flipped_byte_names_the_part_where_the_store_reports_each_parts_checksum(
    bucket, fault_proxy, tmp_path: Path, parallel: bool, per_part: bool
) -> None:
    """S3 answers a HEAD of one part with that part's own checksum (moto does not: the proxy
    adds it, as S3 sends it); the failed check then names the part that differs."""
    sizes = _sizes(bucket)
    data = _blob(sum(sizes), 17)
    upload_multipart(
        bucket.boto3_client(),
        BUCKET,
        "n.tar",
        data,
        sizes,
        checksum="CRC32",
        checksum_type="COMPOSITE",
    )
    if per_part:
        ends = list(accumulate(sizes))
        for number, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True), 1):
            own = base64.b64encode(zlib.crc32(data[start:end]).to_bytes(4, "big")).decode()
            fault_proxy.add_fault(
                "headers",
                times=None,
                method="HEAD",
                path_contains=f"n.tar?partNumber={number}",
                set_headers={"x-amz-checksum-crc32": own},
            )
    flip = {"range_from": sizes[0], "corrupt_at": 7} if parallel else {"corrupt_at": sizes[0] + 7}
    fault_proxy.add_fault("corrupt", times=None, method="GET", path_contains="n.tar", **flip)
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=parallel, retries=0)
    with pytest.raises(IntegrityError) as caught:
        cache.fetch(f"s3://{BUCKET}/n.tar")
    if per_part:
        assert f"part 2 of 3 (bytes {sizes[0]}-{2 * sizes[0] - 1}) has CRC32" in str(caught.value)
        assert caught.value.parts == [2]
    else:
        assert "the store reports no checksum of each part" in str(caught.value)
        assert caught.value.parts == []


def test_a_flipped_byte_of_an_md5_multipart_object_says_no_part_can_be_named(
    bucket, fault_proxy, tmp_path: Path
) -> None:
    sizes = _sizes(bucket)
    upload_multipart(_plain_client(bucket), BUCKET, "m.tar", _blob(sum(sizes), 18), sizes)
    fault_proxy.add_fault("corrupt", times=None, method="GET", path_contains="m.tar")
    cache = _cache(tmp_path, bucket, fault_proxy, parallel=False, retries=0)
    with pytest.raises(IntegrityError, match="the store keeps no MD5 of each part"):
        cache.fetch(f"s3://{BUCKET}/m.tar")
