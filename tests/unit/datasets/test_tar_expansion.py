"""The drop-in stage's tar expansion (shardcache._datasets.tar_expansion) against webdataset's
own (tar_file_expander, then group_by_keys): the same samples, keys in the same order, with
select_files and rename_files, compressed and non-tar shards, handlers; and the damaged
shards where the two differ on purpose."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Callable

import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tars import tar_bytes
from test_tar_members import archives

from shardcache import IntegrityError, ShardFormatError
from shardcache._datasets.tar_expansion import expand
from shardcache._datasets.tar_members import samples


class _Unseekable(io.RawIOBase):
    """A stream that can only be read (standard input, a pipe)."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        chunk = self._data.read(min(len(buffer), 3000))  # short reads, as from a pipe
        buffer[: len(chunk)] = chunk
        return len(chunk)


def _shards(datas: list[bytes], local: bool = True) -> list[dict]:
    return [
        {"url": f"s3://b/{i}.tar", "stream": io.BytesIO(d)}
        | ({"local_path": f"/cache/{i}.tar"} if local else {})
        for i, d in enumerate(datas)
    ]


def _webdataset(datas: list[bytes], handler=wds.reraise_exception, local=True, **options) -> list:
    files = wds.tariterators.tar_file_expander(_shards(datas, local), handler=handler, **options)
    return [list(s.items()) for s in wds.tariterators.group_by_keys(files, handler=handler)]


def _ours(datas: list[bytes], handler=wds.reraise_exception, local=True, **options) -> list:
    return [list(s.items()) for s in expand(_shards(datas, local), handler, **options)]


def _recording(seen: list[BaseException], *, keep: bool) -> Callable[[BaseException], bool]:
    """A handler that records each error and returns ``keep``."""

    def handle(exn: BaseException) -> bool:
        seen.append(exn)
        return keep

    return handle


def _select(name: str) -> bool:
    return not name.endswith(".txt")


def _rename(name: str) -> str:
    return name.replace("seg.", "mask.").upper() if "x" in name else name


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(archives(), min_size=1, max_size=3),
    st.booleans(),
    st.sampled_from([None, _select]),
    st.sampled_from([None, _rename]),
)
def test_the_samples_are_webdatasets_in_its_order(shards, local, select, rename) -> None:
    datas = [data for data, _count in shards]
    options = {"select_files": select, "rename_files": rename}
    assert _ours(datas, local=local, **options) == _webdataset(datas, local=local, **options)


def test_a_stream_that_cannot_seek_is_read_through() -> None:
    data = tar_bytes([("a", {"bin": b"x" * 700, "cls": b"1"}), ("b", {"bin": b"y" * 5})])
    shard = {"url": "-", "stream": _Unseekable(data)}
    got = list(expand([shard], wds.reraise_exception))
    assert [(s["__key__"], s["bin"]) for s in got] == [("a", b"x" * 700), ("b", b"y" * 5)]


def test_a_compressed_shard_reads_as_webdataset_reads_it() -> None:
    good = tar_bytes([("a", {"bin": b"1"}), ("b", {"bin": b"2"})])
    assert _ours([gzip.compress(good), good]) == _webdataset([gzip.compress(good), good])


@pytest.mark.parametrize(
    ("bad", "seen"),
    [
        (b"", "the shard is empty (0 bytes)"),
        (b"hello", "the shard is 5 bytes long, starting b'hello'"),
        (b"this is not a tar file" * 100, "the shard starts b'this is not a ta', not a tar"),
        (
            gzip.compress(tar_bytes([("a", {"bin": b"1" * 9000})]))[:40],
            "the compressed data ends after 40 bytes, before its end: it is truncated",
        ),
    ],
    ids=["empty", "five-bytes", "not-a-tar", "truncated-gzip"],
)
def test_an_empty_or_non_tar_shard_is_a_shard_format_error_naming_it(bad: bytes, seen: str) -> None:
    good = tar_bytes([("a", {"bin": b"1"}), ("b", {"bin": b"2"})])
    with pytest.raises(ShardFormatError) as caught:
        _ours([good, bad])
    message = str(caught.value)
    assert message.startswith(f"s3://b/1.tar: {seen}"), message
    assert "expected a " in message and "re-create or re-upload" in message
    assert " object at 0x" not in message + repr(caught.value)  # wds.warn_and_continue: repr
    errors: list[BaseException] = []
    skipped = _ours([bad, good], handler=_recording(errors, keep=True))
    assert [k for s in skipped for name, k in s if name == "__key__"] == ["a", "b"]
    assert [type(e) for e in errors] == [ShardFormatError]


def _damaged() -> tuple[bytes, bytes]:
    """A shard of 4 samples whose third sample's first header is damaged, and a good one."""
    members = [(f"s{i}", {"bin": bytes([i]) * 1000, "cls": b"c"}) for i in range(4)]
    raw = bytearray(tar_bytes(members, tar_format=tarfile.USTAR_FORMAT))
    third = list(samples(io.BytesIO(bytes(raw)), 0, "x"))[2].offset
    raw[third + 10] ^= 0xFF  # a name byte: the header's checksum fails
    return bytes(raw), tar_bytes([("t", {"bin": b"t"})])


def test_a_damaged_header_is_an_error_where_webdataset_loses_the_rest_silently() -> None:
    damaged, good = _damaged()
    keys = [k for s in _webdataset([damaged, good]) for name, k in s if name == "__key__"]
    assert keys == ["s0", "s1", "t"]  # webdataset: s2 and s3 gone, and no error
    with pytest.raises(ShardFormatError, match="not a tar header") as caught:
        _ours([damaged, good])
    assert caught.value.args[-1] == "s3://b/0.tar"  # the URL appended, as webdataset does
    seen: list[BaseException] = []
    got = _ours([damaged, good], handler=_recording(seen, keep=True))
    assert [k for s in got for name, k in s if name == "__key__"] == ["s0", "s1", "t"]
    assert [type(e) for e in seen] == [ShardFormatError]


@pytest.mark.parametrize("first", ["damaged", "not a tar"])
def test_a_handler_that_returns_false_ends_the_stream(first: str) -> None:
    damaged, good = _damaged()
    bad = damaged if first == "damaged" else b"junk" * 200
    seen: list[BaseException] = []
    got = _ours([bad, good, good], handler=_recording(seen, keep=False))
    assert [k for s in got for name, k in s if name == "__key__"] == (
        ["s0", "s1"] if first == "damaged" else []
    )
    assert len(seen) == 1


class _FailsAtEnd(io.RawIOBase):
    """A shard read while it downloads whose verification failed: its bytes, then the
    verdict's error instead of the end of file."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        chunk = self._data.read(len(buffer))
        if not chunk and len(buffer):
            raise IntegrityError("verification failed", url="s3://b/x.tar")
        buffer[: len(chunk)] = chunk
        return len(chunk)


def test_a_shards_last_sample_waits_for_its_end_of_file_and_a_failure_drops_it() -> None:
    data = tar_bytes([("a", {"bin": b"1"}), ("b", {"bin": b"2"}), ("c", {"bin": b"3"})])
    seen: list[BaseException] = []
    shard = {"url": "s3://b/x.tar", "stream": _FailsAtEnd(data)}
    got = [s["__key__"] for s in expand([shard], _recording(seen, keep=True))]
    assert got == ["a", "b"]  # "c" came last: its end of file never came
    assert [type(e) for e in seen] == [IntegrityError]
    assert seen[0].args[-1] == "s3://b/x.tar"
