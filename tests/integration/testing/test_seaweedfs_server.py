"""The SeaweedFS test server itself (``SeaweedS3Server``): loopback only, two at once, a
bounded stop that leaves nothing, and the multipart objects its helper uploads as S3 keeps
them (ETag, composite and full-object checksums, the part layout)."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import zlib
from pathlib import Path

import pytest

from shardcache.testing import SeaweedS3Server

BUCKET = "helper"
PART = 5 << 20  # S3's smallest non-final part; SeaweedFS refuses less (EntityTooSmall)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on (/proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed since it was listed: the server works meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                host = ".".join(str(b) for b in raw[::-1]) if len(raw) == 4 else address
                found.add((host, int(port, 16)))
    return found


def _crc32(data: bytes) -> bytes:
    return zlib.crc32(data).to_bytes(4, "big")


def test_a_second_server_beside_the_session_one_listens_on_loopback_and_stops_clean(
    seaweedfs: SeaweedS3Server,
) -> None:
    server = SeaweedS3Server().start()  # the session's server runs meanwhile: no clash
    try:
        pid, root = server.pid, server.root
        sockets = _listening(pid)
        assert {host for host, _ in sockets} == {"127.0.0.1"}, sockets
        assert ("127.0.0.1", server.port) in sockets and len(sockets) == 8  # 4 HTTP, 4 gRPC
        grpc = [f"/tmp/seaweedfs-{r}-grpc-{p}.sock" for r, p in server._grpc_ports.items()]
        server.put_objects(BUCKET, {"a": b"x"})
        assert server.boto3_client().get_object(Bucket=BUCKET, Key="a")["Body"].read() == b"x"
    finally:
        server.stop()
    assert not Path(f"/proc/{pid}").exists() and not root.exists()
    assert not [path for path in grpc if os.path.exists(path)]
    server.stop()  # idempotent


def test_put_multipart_stores_what_s3_keeps_of_a_multipart_upload(
    seaweedfs: SeaweedS3Server,
) -> None:
    data = random.Random(3).randbytes(2 * PART + 1000)
    parts = [data[i : i + PART] for i in range(0, len(data), PART)]
    md5s = b"".join(hashlib.md5(p).digest() for p in parts)
    etag = f"{hashlib.md5(md5s).hexdigest()}-3"
    client = seaweedfs.boto3_client()

    plain = seaweedfs.put_multipart(BUCKET, "plain", data, PART)
    assert plain["ETag"].strip('"') == etag and not any(k.startswith("Checksum") for k in plain)

    composite = seaweedfs.put_multipart(BUCKET, "composite", data, PART, checksum="CRC32")
    crc_of_crcs = base64.b64encode(_crc32(b"".join(_crc32(p) for p in parts))).decode()
    assert composite["ChecksumCRC32"] == f"{crc_of_crcs}-3"
    assert composite["ChecksumType"] == "COMPOSITE"

    full = seaweedfs.put_multipart(
        BUCKET, "full", data, PART, checksum="CRC32", checksum_type="FULL_OBJECT"
    )
    assert full["ChecksumCRC32"] == base64.b64encode(_crc32(data)).decode()
    assert full["ChecksumType"] == "FULL_OBJECT"

    for key in ("plain", "composite", "full"):
        head = client.head_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED")
        assert head["ETag"].strip('"') == etag and head["ContentLength"] == len(data)
        first = client.head_object(Bucket=BUCKET, Key=key, PartNumber=1)
        assert (first["ContentLength"], first["PartsCount"]) == (PART, 3)
        last = client.get_object(Bucket=BUCKET, Key=key, PartNumber=3)
        assert last["Body"].read() == parts[2]
    head = client.head_object(Bucket=BUCKET, Key="composite", ChecksumMode="ENABLED")
    assert (head["ChecksumCRC32"], head["ChecksumType"]) == (f"{crc_of_crcs}-3", "COMPOSITE")


def test_reset_deletes_every_bucket(seaweedfs: SeaweedS3Server) -> None:
    seaweedfs.put_objects("one", {"a": b"1"})
    seaweedfs.put_multipart("two", "b", b"2" * 10, 16)  # one part: the last may be small
    seaweedfs.reset()
    assert seaweedfs.boto3_client().list_buckets()["Buckets"] == []


def test_a_missing_binary_is_a_missing_extra_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardcache import MissingExtraError
    from shardcache.testing import seaweedfs as module

    monkeypatch.setattr(module, "weed_binary", lambda: None)
    server = SeaweedS3Server()
    with pytest.raises(MissingExtraError, match="setup-venv"):
        server.start()
    server.stop()
