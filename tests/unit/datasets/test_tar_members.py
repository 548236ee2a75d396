"""Samples with their byte offsets (shardcache._datasets.tar_members) against webdataset's own tar
expansion, over every tar format tarfile writes."""

from __future__ import annotations

import contextlib
import io
import tarfile

import pytest
import webdataset as wds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tars import tar_bytes

from shardcache import ShardFormatError
from shardcache._datasets.tar_members import samples

FORMATS = [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]
_segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=60)


@st.composite
def archives(draw: st.DrawFn) -> tuple[bytes, int]:
    tar_format = draw(st.sampled_from(FORMATS))
    # Long keys (GNU long names, pax paths, ustar prefixes) only where the format has them.
    depth = 1 if tar_format == tarfile.USTAR_FORMAT else 3
    keys = draw(st.lists(st.lists(_segment, min_size=1, max_size=depth).map("/".join), max_size=12))
    # Keys must differ from their neighbours, or webdataset would merge the two samples.
    keys = [key for i, key in enumerate(keys) if i == 0 or key != keys[i - 1]]
    suffix = st.sampled_from(["jpg", "cls", "JSON", "seg.png", "txt"])
    sample_list = [
        (
            key,
            draw(
                st.dictionaries(suffix, st.binary(max_size=1300), min_size=1, max_size=3).filter(
                    lambda files: len({s.lower() for s in files}) == len(files)
                )
            ),
        )
        for key in keys
    ]
    extras = draw(
        st.lists(
            st.tuples(st.integers(0, max(0, len(keys) - 1)), st.sampled_from(["d/", "__index__"])),
            max_size=2,
        )
    )
    return tar_bytes(sample_list, tar_format=tar_format, extras=extras), len(keys)


def _webdataset(data: bytes) -> list[dict]:
    files = wds.tariterators.tar_file_expander([{"stream": io.BytesIO(data), "url": "x"}])
    return [
        {k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"}
        for s in wds.tariterators.group_by_keys(files)
    ]


def _ours(data: bytes, offset: int = 0, **options) -> list:
    stream = io.BufferedReader(io.BytesIO(data))  # type: ignore[arg-type]
    stream.seek(offset)
    return list(samples(stream, offset, "x.tar", **options))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(archives())
def test_samples_and_offsets_match_webdataset(archive: tuple[bytes, int]) -> None:
    data, _count = archive
    ours = _ours(data)
    assert [{"__key__": s.key, **s.files} for s in ours] == _webdataset(data)
    for index, sample in enumerate(ours):
        # Reading from a sample's offset gives it (only_one) and everything after it.
        (again,) = _ours(data, sample.offset, only_one=True)
        assert (again.key, again.files) == (sample.key, sample.files)
        rest = _ours(data, sample.offset)
        assert [s.key for s in rest] == [s.key for s in ours[index:]]
        if sample.end >= 0:  # where the next one starts, and its key
            assert (sample.end, sample.next_key) == (ours[index + 1].offset, ours[index + 1].key)
        else:
            assert index == len(ours) - 1


def test_an_offset_inside_a_member_is_refused() -> None:
    data = tar_bytes([("a", {"bin": b"x" * 2000}), ("b", {"bin": b"y" * 10})])
    with pytest.raises(ShardFormatError, match="not a tar header") as caught:
        _ours(data, 1024)
    assert "x.tar at byte 1024" in str(caught.value)


def test_a_truncated_shard_is_refused_with_where_it_ends() -> None:
    data = tar_bytes([("a", {"bin": b"x" * 2000})])
    with pytest.raises(ShardFormatError, match="ends inside a tar member"):
        _ours(data[:1200])


def test_a_repeated_suffix_is_refused_as_webdataset_refuses_it() -> None:
    data = tar_bytes([("a", {"jpg": b"1"}), ("a", {"JPG": b"2"})])
    with pytest.raises(ShardFormatError, match="repeats the suffix 'jpg'"):
        _ours(data)
    with pytest.raises(ValueError, match="duplicate file name"):
        _webdataset(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(archives(), st.data())
def test_damaged_archives_raise_shard_format_error_or_read(archive, data) -> None:
    """Any damage (bytes overwritten anywhere, the end cut) gives samples or a
    ShardFormatError: never another exception, never a hang."""
    raw = bytearray(archive[0])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at : at + 8] = data.draw(st.binary(min_size=1, max_size=8))
    cut = data.draw(st.integers(0, len(raw)))
    with contextlib.suppress(ShardFormatError):
        _ours(bytes(raw[:cut]))
