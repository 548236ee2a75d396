"""The one byte range a mesh server answers."""

from __future__ import annotations

import pytest

from shardcache._mesh.served import NotServed
from shardcache._mesh.server import ByteRange


@pytest.mark.parametrize(
    ("header", "offset", "count", "partial"),
    [
        ("", 0, 100, False),
        ("bytes=0-9", 0, 10, True),
        ("bytes=90-", 90, 10, True),
        ("bytes=90-1000", 90, 10, True),
        ("bytes=-30", 70, 30, True),
        ("bytes=-300", 0, 100, True),
    ],
)
def test_ranges_within_the_file(header, offset, count, partial) -> None:
    chosen = ByteRange(header, 100)
    assert (chosen.offset, chosen.count, chosen.partial) == (offset, count, partial)


@pytest.mark.parametrize(
    "header", ["bytes=100-", "bytes=5-2", "bytes=0-1,5-6", "items=0-1", "bytes=a-b", "bytes=5"]
)
def test_other_ranges_are_416(header) -> None:
    with pytest.raises(NotServed) as refused:
        ByteRange(header, 100)
    assert refused.value.status == 416
