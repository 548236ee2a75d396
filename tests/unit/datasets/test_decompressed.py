"""Compressed shards (gzip, bzip2, xz, lzma: what webdataset's ``tarfile`` recognises) on both
tar paths: ``stage()``'s streams read by webdataset's own ``tar_file_expander`` and
``group_by_keys``, and the drop-in's expansion (``shardcache.WebDataset``). A good shard reads
as plain webdataset reads it; every cut, flipped byte, non-tar content and empty file is a
``ShardFormatError`` naming the shard, where webdataset raises ``zlib.error``, ``EOFError``
or ``tarfile.ReadError`` or reads on without an error."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import random
import tarfile
import zlib
from collections.abc import Callable

import pytest
import webdataset as wds
from tars import Chunks, tar_bytes

from shardcache import ShardFormatError
from shardcache._datasets.decompressed import Opened
from shardcache._datasets.tar_expansion import expand
from shardcache._datasets.wds import _tar_guarded

URL = "s3://b/shard-000007.tar.gz"
COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "bzip2": bz2.compress,
    "xz": lzma.compress,
    "lzma": lambda data: lzma.compress(data, format=lzma.FORMAT_ALONE),
}


def _tar() -> bytes:
    """Six samples, part random (incompressible), part text, sizes leaving tar padding."""
    rng = random.Random(42)
    return tar_bytes(
        [
            (f"s{i:03d}", {"bin": rng.randbytes(300 + 97 * i), "txt": f"label {i} ".encode() * 40})
            for i in range(6)
        ]
    )


def _webdataset(shards: list[dict]) -> list[list]:
    files = wds.tariterators.tar_file_expander(shards, handler=wds.reraise_exception)
    samples = wds.tariterators.group_by_keys(files, handler=wds.reraise_exception)
    return [list(s.items()) for s in samples]


def _plain(data: bytes) -> list[list]:
    """What webdataset alone gives."""
    return _webdataset([{"url": URL, "stream": io.BytesIO(data)}])


def _staged(data: bytes, chunk: int = 1 << 20) -> list[list]:
    """``stage()``'s stream (decompressed, tar-checked), read by webdataset's expansion."""
    return _webdataset(list(_tar_guarded([{"url": URL, "stream": Chunks(data, chunk)}])))


def _dropin(data: bytes, chunk: int = 1 << 20) -> list[list]:
    """The drop-in's expansion (``shardcache.WebDataset``)."""
    shards = [{"url": URL, "stream": Chunks(data, chunk)}]
    return [list(s.items()) for s in expand(shards, wds.reraise_exception)]


PATHS = {"stage": _staged, "dropin": _dropin}


def _offsets(length: int, start: int) -> list[int]:
    """Every offset in the first and last 64 bytes (gzip's header, the deflate stream's end,
    its CRC and length), every 5th in between."""
    return sorted(
        {*range(start, start + 64), *range(start, length, 5), *range(length - 64, length)}
    )


@pytest.mark.parametrize("kind", COMPRESSORS)
@pytest.mark.parametrize("path", PATHS)
def test_a_good_compressed_shard_reads_as_webdataset_reads_it(kind: str, path: str) -> None:
    packed = COMPRESSORS[kind](_tar())
    expected = _plain(packed)
    assert len(expected) == 6
    for chunk in (1, 7, 512, 1 << 20):  # the stream's reads cut anywhere
        assert PATHS[path](packed, chunk) == expected, chunk


@pytest.mark.parametrize("path", PATHS)
def test_concatenated_gzip_members_and_zero_padding_read_as_one_tar(path: str) -> None:
    data = _tar()
    packed = gzip.compress(data[:4000]) + gzip.compress(data[4000:]) + bytes(700)
    assert PATHS[path](packed) == _plain(gzip.compress(data))
    with pytest.raises(tarfile.ReadError):
        _plain(packed)  # webdataset's tarfile reads the first member only


@pytest.mark.parametrize("path", PATHS)
def test_bytes_after_the_compressed_data_are_a_shard_format_error(path: str) -> None:
    packed = gzip.compress(_tar()) + b"\0\0junk"
    with pytest.raises(ShardFormatError, match="damaged near compressed byte"):
        PATHS[path](packed)


@pytest.mark.parametrize("path", PATHS)
def test_every_cut_of_a_gzipped_tar_is_a_shard_format_error_naming_it(path: str) -> None:
    packed = gzip.compress(_tar())
    raw: set[str] = set()
    for cut in _offsets(len(packed), 0):
        with pytest.raises(ShardFormatError) as caught:
            PATHS[path](packed[:cut], (7, 512, 1 << 20)[cut % 3])
        assert str(caught.value).startswith(f"{URL}: "), (cut, caught.value)
        assert "re-create or re-upload" in str(caught.value)
        try:
            _plain(packed[:cut])
        except Exception as exn:
            raw.add(type(exn).__name__)
        else:
            raw.add("no error")
    # What webdataset alone gives for the same cuts.
    assert {"ReadError", "no error"} <= raw and raw.isdisjoint({"ShardFormatError"}), raw


@pytest.mark.parametrize("kind", ["bzip2", "xz", "lzma"])
@pytest.mark.parametrize("path", PATHS)
def test_cuts_of_other_compressions_are_shard_format_errors(kind: str, path: str) -> None:
    packed = COMPRESSORS[kind](_tar())
    for cut in sorted({*range(0, len(packed), 61), len(packed) - 1, len(packed) - 5}):
        with pytest.raises(ShardFormatError) as caught:
            PATHS[path](packed[:cut])
        assert str(caught.value).startswith(URL), (cut, caught.value)


@pytest.mark.parametrize("path", PATHS)
def test_a_flipped_byte_in_the_compressed_data_is_a_shard_format_error(path: str) -> None:
    packed = gzip.compress(_tar())
    silent = 0
    for at in _offsets(len(packed), 10):  # after the header's time, flags and OS fields
        damaged = bytearray(packed)
        damaged[at] ^= 0xFF
        with pytest.raises(ShardFormatError) as caught:
            PATHS[path](bytes(damaged))
        assert str(caught.value).startswith(URL), (at, caught.value)
        assert any(w in str(caught.value) for w in ("damaged", "not a tar header", "truncated"))
        with contextlib.suppress(zlib.error, EOFError, tarfile.ReadError):
            silent += _plain(bytes(damaged)) is not None  # webdataset: no error
    assert silent, "webdataset alone raised for every flipped byte"


@pytest.mark.parametrize("path", PATHS)
def test_the_gzip_header_s_time_and_os_fields_are_not_checked(path: str) -> None:
    packed = bytearray(gzip.compress(_tar()))
    packed[4:10] = b"\x01\x02\x03\x04\x00\x0b"  # mtime, extra flags, OS: not covered by the CRC
    assert PATHS[path](bytes(packed)) == _plain(gzip.compress(_tar()))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("data", "seen"),
    [
        (gzip.compress(b"<html>not found</html>" * 40), "not a tar header"),
        (gzip.compress(b""), "the gzip-compressed shard holds 0 bytes once decompressed"),
        (gzip.compress(b"")[:12], "the compressed data ends after 12 bytes"),
        (b"", "the shard is empty"),
        (gzip.compress(lzma.compress(_tar())), "the shard is xz-compressed"),
        (b"\x28\xb5\x2f\xfd" + bytes(600), "the shard is zstd-compressed, which this reader"),
    ],
    ids=["gzip-of-html", "gzip-of-nothing", "gzip-header-only", "empty-file", "gzip-of-xz", "zstd"],
)
def test_a_compressed_non_tar_or_empty_shard_is_a_shard_format_error(
    path: str, data: bytes, seen: str
) -> None:
    with pytest.raises(ShardFormatError) as caught:
        PATHS[path](data)
    assert str(caught.value).startswith(f"{URL}: "), caught.value
    assert seen in str(caught.value) and "expected a" in str(caught.value)
    with pytest.raises(tarfile.ReadError):
        _plain(data)


@pytest.mark.parametrize("path", PATHS)
def test_a_gzipped_empty_tar_has_no_samples_as_in_webdataset(path: str) -> None:
    packed = gzip.compress(tar_bytes([]))
    assert PATHS[path](packed) == _plain(packed) == []


@pytest.mark.parametrize("kind", COMPRESSORS)
def test_a_highly_compressed_shard_is_decompressed_a_bounded_piece_at_a_time(kind: str) -> None:
    packed = COMPRESSORS[kind](bytes(8 << 20))  # 8 MiB of zeros: a few kB compressed
    stream = Opened(io.BytesIO(packed), URL)
    assert stream.read(512) == bytes(512)
    inner = stream._inner  # the decompressed bytes it holds
    assert len(inner._out) - inner._pos < 1 << 20
    total = 512
    while piece := stream.read(3 << 20):
        assert piece.count(0) == len(piece)
        total += len(piece)
    assert total == 8 << 20
