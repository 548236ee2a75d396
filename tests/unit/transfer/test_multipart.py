"""A multipart upload's layout and checksums computed as S3 computes them, and which
checksum a download is checked against."""

from __future__ import annotations

import base64
import hashlib
import random
import zlib

import pytest

from shardcache._transfer.checksums import Checksum, etag_checksum, expected
from shardcache._transfer.download import ObjectInfo
from shardcache._transfer.multipart import PartLayout, PartsHasher, composite_value
from shardcache._transfer.remote import etag_is_md5, s3_object_info

DATA = random.Random(1).randbytes(100_000)
SIZES = [30_000, 30_000, 30_000, 10_000]


def _parts(data: bytes, sizes: list[int]) -> list[bytes]:
    out, start = [], 0
    for size in sizes:
        out.append(data[start : start + size])
        start += size
    return out


def test_the_md5_of_md5s_is_the_multipart_etag_whatever_the_pieces_fed() -> None:
    """S3's multipart ETag: the MD5 of the parts' MD5 digests joined."""
    want = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in _parts(DATA, SIZES)))
    for piece in (1, 7_777, 30_000, 100_000):
        hasher = PartsHasher("md5", PartLayout(tuple(SIZES)))
        for start in range(0, len(DATA), piece):
            hasher.update(DATA[start : start + piece])
        assert hasher.value() == want.hexdigest()


def test_a_composite_crc32_joins_the_parts_big_endian_crcs() -> None:
    digests = [zlib.crc32(p).to_bytes(4, "big") for p in _parts(DATA, SIZES)]
    want = base64.b64encode(zlib.crc32(b"".join(digests)).to_bytes(4, "big")).decode()
    hasher = PartsHasher("crc32", PartLayout(tuple(SIZES)))
    hasher.update(DATA)
    assert hasher.value() == want == composite_value("crc32", digests)


def test_a_regular_layout_is_taken_only_where_the_count_fits() -> None:
    layout = PartLayout.regular(30_000, 4, 100_000)
    assert layout is not None and layout.sizes == tuple(SIZES) and layout.assumed
    assert PartLayout.regular(30_000, 5, 100_000) is None  # 4 parts would hold it
    assert PartLayout.regular(30_000, 3, 100_000) is None
    assert PartLayout.regular(0, 3, 100_000) is None


def test_a_layout_is_recorded_in_runs_and_read_back() -> None:
    layout = PartLayout((5, 5, 5, 7, 5, 2))
    assert layout.as_record() == [[5, 3], [7, 1], [5, 1], [2, 1]]
    assert PartLayout.from_record(layout.as_record()) == layout
    assert layout.spans()[3] == (15, 22)
    for bad in (None, "x", [[5]], [[0, 1]], []):
        assert PartLayout.from_record(bad) is None


@pytest.mark.parametrize(
    ("etag", "want"),
    [
        ("0123456789abcdef0123456789abcdef", ("0123456789abcdef0123456789abcdef", None)),
        ("0123456789abcdef0123456789abcdef-12", ("0123456789abcdef0123456789abcdef", 12)),
        ("0123456789ABCDEF0123456789ABCDEF", None),
        ("not-an-md5", None),
        ("0123456789abcdef0123456789abcdef-0", None),
        (None, None),
    ],
)
def test_an_etag_is_an_md5_only_in_the_form_of_one(etag: str | None, want: tuple | None) -> None:
    got = etag_checksum(etag)
    assert (got.value, got.parts) == want if want else got is None


@pytest.mark.parametrize(
    ("url", "headers", "promised"),
    [
        ("s3://b/k", {}, True),
        ("s3://b/k", {"ServerSideEncryption": "AES256"}, True),
        ("s3://b/k", {"ServerSideEncryption": "aws:kms"}, False),
        ("s3://b/k", {"ServerSideEncryption": "aws:kms:dsse"}, False),
        ("s3://b/k", {"SSECustomerAlgorithm": "AES256"}, False),
        ("s3://data--use1-az4--x-s3/k", {}, False),
    ],
)
def test_an_etag_is_taken_for_an_md5_only_where_s3_promises_it(
    url: str, headers: dict, promised: bool
) -> None:
    assert etag_is_md5(url, headers) is promised
    response = {"ETag": '"0123456789abcdef0123456789abcdef-3"', "ContentLength": 9} | headers
    info = s3_object_info(url, response)
    assert (info.md5_checksum is not None) is promised
    assert s3_object_info(url, response, etag_md5="off").md5_checksum is None


def test_the_cheapest_described_checksum_is_expected() -> None:
    full = Checksum("crc32c", "AAAAAA==", "x-amz-checksum-crc32c")
    composite = Checksum("crc32", "AAAAAA==", "x-amz-checksum-crc32", parts=3)
    md5 = Checksum("md5", "0" * 32, "the ETag")
    md5_parts = Checksum("md5", "0" * 32, "the ETag", parts=3)

    def info(checksum: Checksum | None, etag: Checksum | None) -> ObjectInfo:
        return ObjectInfo("s3://b/k", 9, md5_checksum=etag, checksum=checksum)

    assert expected(info(full, md5), "etag") is full
    assert expected(info(None, md5), "etag") is md5
    assert expected(info(composite, md5_parts), "etag") is composite
    assert expected(info(None, md5_parts), "etag") is md5_parts
    assert expected(info(composite, md5_parts), "strict") is composite
    assert expected(info(full, md5), "size") is None
    assert expected(info(None, None), "etag") is None
