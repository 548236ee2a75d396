"""What a peer's copy is checked against, from its holder's record: the CRC32C it recorded
as the bytes landed, else (an older record) the store's checksum it was verified by; a
record naming nothing usable is refused before any byte, never an error of another kind."""

from __future__ import annotations

import base64

import pytest
from awscrt import checksums

from shardcache import IntegrityError, PeerFetchError
from shardcache._mesh.client import Peer
from shardcache._mesh.verify import Expected, PeerCheck

DATA = b"shard bytes" * 1000
PEER = Peer("10.0.0.2", 4000)
URL = "s3://bucket/a.tar"


def _crc32c(data: bytes) -> str:
    return base64.b64encode(checksums.crc32c(data).to_bytes(4, "big")).decode()


def _check(record: dict) -> PeerCheck:
    return PeerCheck(URL, PEER, {"size": len(DATA), **record}, Expected(size=len(DATA)))


def test_the_recorded_crc32c_is_what_the_bytes_are_checked_against() -> None:
    check = _check({"mesh_crc32c": _crc32c(DATA), "verified": "size"})
    check.update(memoryview(DATA))
    check.finish()
    damaged = _check({"mesh_crc32c": _crc32c(DATA), "verified": "size"})
    damaged.update(memoryview(DATA[:-1] + b"!"))
    with pytest.raises(IntegrityError, match="CRC32C") as caught:
        damaged.finish()
    assert caught.value.peer == str(PEER)


@pytest.mark.parametrize(
    "record",
    [
        {"verified": "size"},
        {"verified": "crc32", "checksum": {"algorithm": "crc32", "value": "x", "parts": "many"}},
        {"verified": "nohash", "checksum": {"algorithm": "nohash", "value": "x"}},
    ],
    ids=["size-only", "unreadable-parts", "unknown-algorithm"],
)
def test_a_record_naming_nothing_usable_is_refused_before_any_byte(record: dict) -> None:
    with pytest.raises(PeerFetchError, match="of the cache mesh") as refused:
        _check(record)
    assert refused.value.peer == str(PEER)


def test_another_size_than_expected_is_refused() -> None:
    with pytest.raises(PeerFetchError, match="holds size"):
        PeerCheck(URL, PEER, {"size": 5, "mesh_crc32c": "AAAAAA=="}, Expected(size=6))
