"""A peer's whole copy is checked as it arrives against the checksum its holder recorded
from the store: a flipped byte in the holder's file (bit rot in place: same inode, same
record) is caught and named with the peer; another version, or a record without a checksum,
is refused before any byte is taken; a multipart upload's copy checks over its parts."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from mesh_holder import Holder

from shardcache import IntegrityError, PeerFetchError, ShardCache
from shardcache._disk.metadata import read_meta, write_meta
from shardcache._mesh.auth import JobKey, Verifier
from shardcache._mesh.client import Peer
from shardcache._mesh.served import ShardRequest
from shardcache._mesh.server import MeshServer
from shardcache._mesh.verify import Expected, fetch_verified

BUCKET = "meshverify"
SECRET = bytes(range(32, 64))
JOB = "job-verify"


@pytest.fixture
def node(s3, tmp_path: Path) -> Holder:
    single = {"single.tar": random.Random(1).randbytes(700_000)}
    multi = {"multi.tar": random.Random(2).randbytes(12 << 20)}
    s3.put_objects(BUCKET, single)
    s3.put_objects(BUCKET, multi, multipart_chunk=5 << 20)
    cache = ShardCache(tmp_path / "cache", scope="node", retry_backoff=0.01)
    blobs = {f"s3://{BUCKET}/{k}": v for k, v in {**single, **multi}.items()}
    for url in blobs:
        cache.fetch(url)
    return Holder(cache, blobs, list(blobs))


@pytest.fixture
def server(node: Holder) -> Iterator[MeshServer]:
    with MeshServer(node.shards(), Verifier(JobKey(SECRET, JOB)), "127.0.0.1") as running:
        yield running


def _fetch(server: MeshServer, request: ShardRequest, **kw) -> bytes:
    got = bytearray()
    fetch_verified(Peer("127.0.0.1", server.port), JobKey(SECRET, JOB), request, got.extend, **kw)
    return bytes(got)


@pytest.mark.parametrize("crc32c", [True, False], ids=["mesh_crc32c", "older-record"])
@pytest.mark.parametrize("name", ["single.tar", "multi.tar"])
def test_a_good_copy_is_checked_and_delivered(node, server, name, crc32c) -> None:
    url = f"s3://{BUCKET}/{name}"
    path = node.cache.path_for(url)
    record = read_meta(node.cache.layout, path)
    # moto: a CRC32 of a single-part upload; the ETag's MD5 of the 3 parts' MD5s of the other
    assert record["verified"] == {"single.tar": "crc32", "multi.tar": "md5-parts"}[name]
    assert record["mesh_crc32c"]  # every download records one
    if not crc32c:  # a record made before mesh_crc32c: checked against the store's checksum
        write_meta(node.cache.layout, path, {**record, "mesh_crc32c": None})
    expected = Expected(record["size"], record["etag"], record["version_id"])
    assert _fetch(server, node.requests[url], expected=expected) == node.blobs[url]


def test_a_flipped_byte_in_the_holders_copy_is_caught_and_names_the_peer(node, server) -> None:
    url = f"s3://{BUCKET}/single.tar"
    path = node.cache.path_for(url)
    inode = path.stat().st_ino
    with open(path, "r+b") as copy:  # bit rot: in place, the record still describes the file
        copy.seek(123_456)
        byte = copy.read(1)
        copy.seek(123_456)
        copy.write(bytes([byte[0] ^ 0x01]))
    assert path.stat().st_ino == inode
    with pytest.raises(IntegrityError) as caught:
        _fetch(server, node.requests[url])
    assert caught.value.peer == f"127.0.0.1:{server.port}"
    assert f"from peer 127.0.0.1:{server.port}" in str(caught.value)
    assert server.wait_idle(5)
    assert server.counts()["200"] == 1  # the server sent it: the receiver caught it


def test_another_version_is_refused_before_any_byte(node, server) -> None:
    url = f"s3://{BUCKET}/single.tar"
    sink_calls = []
    with pytest.raises(PeerFetchError, match="holds etag") as refused:
        fetch_verified(
            Peer("127.0.0.1", server.port),
            JobKey(SECRET, JOB),
            node.requests[url],
            sink_calls.append,
            expected=Expected(etag="0" * 32),
        )
    assert sink_calls == [] and refused.value.peer == f"127.0.0.1:{server.port}"


def test_a_copy_without_any_recorded_checksum_is_refused(node, server) -> None:
    url = f"s3://{BUCKET}/single.tar"
    path = node.cache.path_for(url)
    record = read_meta(node.cache.layout, path)
    write_meta(node.cache.layout, path, {**record, "verified": "size", "mesh_crc32c": None})
    with pytest.raises(PeerFetchError, match="recorded no checksum"):
        _fetch(server, node.requests[url])
