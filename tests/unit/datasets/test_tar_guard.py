"""The tar check on ``shardcache.stage()``'s streams, read by webdataset's own tar reader:
every cut of a real tar either reads as webdataset reads it, or raises ``ShardFormatError``
exactly where webdataset's ``tarfile`` or shardcache's own reader finds it not complete."""

from __future__ import annotations

import io
import tarfile

import pytest
import webdataset as wds
from tars import Chunks

from shardcache import ShardFormatError
from shardcache._datasets.tar_guard import TarGuard
from shardcache._datasets.tar_members import samples

URL = "s3://b/shard.tar"


def _tar(fmt: int) -> bytes:
    """A directory, a long name (pax or GNU extension header), and data sizes that leave
    padding and fall on block boundaries."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for i, size in enumerate((10, 512, 0, 700)):
            for suffix in ("txt", "bin"):
                name = f"{'d' * 120}/s{i}.{suffix}" if i == 2 else f"s{i}.{suffix}"
                info = tarfile.TarInfo(name)
                info.size = size + len(suffix)
                tar.addfile(info, io.BytesIO(bytes([i]) * info.size))
    return out.getvalue()


def _webdataset(stream: object, handler=wds.reraise_exception) -> list[dict]:
    """The files webdataset's tar expansion gives (its end-of-shard markers left out)."""
    shard = {"url": URL, "stream": stream}
    return [f for f in wds.tariterators.tar_file_expander([shard], handler=handler) if f]


def _incomplete(data: bytes) -> bool:
    """Whether webdataset's reader raises on ``data`` or shardcache's finds it damaged."""
    try:
        _webdataset(io.BytesIO(data))
        list(samples(io.BytesIO(data), 0, URL))
    except Exception:
        return True
    return False


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_every_cut_is_read_whole_or_is_a_shard_format_error(fmt: int) -> None:
    data = _tar(fmt)
    assert _webdataset(TarGuard(Chunks(data, 10240), URL)) == _webdataset(io.BytesIO(data))
    cuts = sorted(  # every block boundary and either side of it, and offsets between
        {*range(0, len(data), 97), *(b + d for b in range(0, len(data), 512) for d in (-1, 0, 1))}
    )
    for n, cut in enumerate(c for c in cuts if 0 <= c < len(data)):
        chunk = (7, 512, 10240)[n % 3]
        expected = _incomplete(data[:cut])
        try:
            got = _webdataset(TarGuard(Chunks(data[:cut], chunk), URL))
        except ShardFormatError as exn:
            assert expected, (cut, exn)
            assert URL in str(exn) and "Check the source object" in str(exn)
        else:
            assert not expected, cut
            assert got == _webdataset(io.BytesIO(data[:cut]))


@pytest.mark.parametrize(
    ("bad", "seen"),
    [
        (b"", "the shard is empty"),
        (b"hello", "5 bytes long"),
        (b"<html>" + b"x" * 2000, "not a tar header"),
    ],
)
def test_an_empty_or_non_tar_stream_is_a_shard_format_error_naming_it(
    bad: bytes, seen: str
) -> None:
    with pytest.raises(tarfile.ReadError):
        _webdataset(io.BytesIO(bad))  # what webdataset alone gives
    with pytest.raises(ShardFormatError, match=seen) as raised:
        _webdataset(TarGuard(io.BytesIO(bad), URL))
    assert f"{URL}: " in str(raised.value) and "expected a tar file" in str(raised.value)


def test_a_damaged_header_is_an_error_where_tarfile_ends_the_shard_silently() -> None:
    data = bytearray(_tar(tarfile.GNU_FORMAT))
    second = 512 + 512 + 512  # the folder's header, s0.txt's header and data
    data[second + 10] ^= 0xFF
    assert len(_webdataset(io.BytesIO(bytes(data)))) == 1  # webdataset: s0.txt, then nothing
    with pytest.raises(ShardFormatError, match=f"at byte {second}: not a tar header"):
        _webdataset(TarGuard(io.BytesIO(bytes(data)), URL))


def test_a_skipping_handler_is_called_once_and_the_next_shard_is_read() -> None:
    whole = _tar(tarfile.PAX_FORMAT)
    seen: list[BaseException] = []

    def skip(exn: BaseException) -> bool:
        seen.append(exn)
        return True

    shards = [
        {"url": "bad", "stream": TarGuard(io.BytesIO(whole[:1000]), "bad")},
        {"url": URL, "stream": TarGuard(io.BytesIO(whole), URL)},
    ]
    got = [f for f in wds.tariterators.tar_file_expander(shards, handler=skip) if f]
    assert [type(e) for e in seen] == [ShardFormatError]
    assert "bad: the shard ends after 1000 bytes" in str(seen[0])
    assert [s["fname"] for s in got if s.get("__url__") == URL] == [
        s["fname"] for s in _webdataset(io.BytesIO(whole))
    ]
