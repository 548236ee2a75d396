"""The test infrastructure itself: moto S3 server, request counting and the fault proxy."""

from __future__ import annotations

import hashlib
import socket
import threading
from typing import Any

import aiohttp
import botocore.exceptions
import fsspec
import pytest
import s3fs

from shardcache.testing import FaultProxy, S3Server
from shardcache.testing.s3server import parse_log_line

BUCKET = "infra"
DATA = bytes(range(256)) * 400  # 100 KiB


def _fs(s3: S3Server, proxy: FaultProxy, *, attempts: int | None = None, **config: Any) -> Any:
    """An s3fs filesystem through ``proxy``; ``attempts`` caps botocore and s3fs retries."""
    if attempts is not None:
        config["retries"] = {"total_max_attempts": attempts}
    fs = s3fs.S3FileSystem(
        skip_instance_cache=True,
        config_kwargs=config,
        **s3.storage_options(proxy.endpoint_url),
    )
    if attempts is not None:
        fs.retries = attempts
    return fs


def _no_retry_client(s3: S3Server, proxy: FaultProxy, **config: Any) -> Any:
    return s3.boto3_client(proxy.endpoint_url, retries={"total_max_attempts": 1}, **config)


# ---------------------------------------------------------------------------- S3Server


def test_objects_put_are_readable_through_the_env_endpoint(s3: S3Server) -> None:
    s3.put_objects(BUCKET, {"a.bin": DATA, "dir/b c%.bin": b"hello"})
    fs = fsspec.filesystem("s3")  # configured only by the AWS_* env from the fixture
    assert fs.cat(f"{BUCKET}/a.bin") == DATA
    assert fs.cat(f"{BUCKET}/dir/b c%.bin") == b"hello"
    assert sorted(fs.ls(BUCKET)) == [f"{BUCKET}/a.bin", f"{BUCKET}/dir"]


def test_get_counting_is_exact(s3: S3Server) -> None:
    s3.put_objects(BUCKET, {"a.bin": DATA, "dir/b c%.bin": b"hello"})
    s3.clear_requests()  # forget put_objects' own requests
    fs = s3fs.S3FileSystem(**s3.storage_options())
    fs.cat_file(f"{BUCKET}/a.bin")
    fs.cat_file(f"{BUCKET}/a.bin")
    fs.cat_file(f"{BUCKET}/dir/b c%.bin")
    client = s3.boto3_client()
    client.get_object(Bucket=BUCKET, Key="a.bin", Range="bytes=0-9")["Body"].read()

    assert s3.count("GET", BUCKET, "a.bin") == 3
    assert s3.count("GET", BUCKET, "dir/b c%.bin") == 1
    assert s3.count("GET", BUCKET, "missing") == 0
    ranged = [r for r in s3.requests("GET", f"/{BUCKET}/a.bin") if r.status == 206]
    assert len(ranged) == 1  # the 206 line carries ANSI colours in the log
    assert all(r.key == "dir/b c%.bin" for r in s3.requests(path_prefix=f"/{BUCKET}/dir/"))
    s3.clear_requests()
    assert s3.count() == 0


def test_put_objects_before_a_reset_are_counted(s3: S3Server) -> None:
    s3.put_objects(BUCKET, {"k": b"v"})
    assert s3.count("PUT", BUCKET, "k") == 1


def test_reset_drops_data_and_counters(s3: S3Server) -> None:
    s3.put_objects(BUCKET, {"k": b"v"})
    s3.reset()
    assert s3.requests() == []
    client = s3.boto3_client()
    assert client.list_buckets()["Buckets"] == []


def test_multipart_upload_has_a_dash_etag(s3: S3Server) -> None:
    etags = s3.put_objects(BUCKET, {"mp.bin": DATA}, multipart_chunk=40_000)
    assert etags["mp.bin"].endswith("-3")
    single = s3.put_objects(BUCKET, {"sp.bin": DATA})
    assert single["sp.bin"] == hashlib.md5(DATA).hexdigest()
    info = s3fs.S3FileSystem(**s3.storage_options()).info(f"{BUCKET}/mp.bin")
    assert "-" in info["ETag"]
    assert info["size"] == len(DATA)


def test_parse_log_line_strips_colours_and_decodes() -> None:
    line = (
        '127.0.0.1 - - [21/Nov/2026 23:50:30] "\x1b[35m\x1b[1mGET /bkt/a%20b/c%25d+\\x07.txt'
        '?x=1&y=%2F HTTP/1.1\x1b[0m" 206 -\n'
    )
    req = parse_log_line(line)
    assert req is not None
    assert (req.method, req.path, req.query, req.status) == (
        "GET",
        "/bkt/a b/c%d+\x07.txt",
        "x=1&y=%2F",
        206,
    )
    assert (req.bucket, req.key) == ("bkt", "a b/c%d+\x07.txt")
    assert parse_log_line(" * Running on http://127.0.0.1:5000") is None


@pytest.mark.timeout(60)
def test_server_lifecycle_is_idempotent() -> None:
    server = S3Server()
    server.stop()  # never started: no-op
    with server:
        assert server.running
        url = server.endpoint_url
        assert url.startswith("http://127.0.0.1:")
    assert not server.running
    server.stop()
    with pytest.raises(RuntimeError):
        _ = server.endpoint_url


# ---------------------------------------------------------------------------- FaultProxy


@pytest.mark.timeout(20)
def test_proxy_passes_traffic_through_with_keepalive(s3: S3Server, fault_proxy: FaultProxy) -> None:
    s3.put_objects(BUCKET, {"a.bin": DATA})
    fs = _fs(s3, fault_proxy)
    big = DATA * 30  # 3 MB upload through the proxy
    fs.pipe_file(f"{BUCKET}/big.bin", big)
    for _ in range(3):
        assert fs.cat_file(f"{BUCKET}/a.bin") == DATA
    assert fs.cat_file(f"{BUCKET}/big.bin") == big
    stats = fault_proxy.stats()
    assert stats.faults == {}
    assert stats.forwarded == stats.requests >= 5
    assert stats.connections < stats.requests  # client connections are reused
    assert s3.count("GET", BUCKET, "a.bin") == 3


@pytest.mark.timeout(20)
def test_status_fault_is_answered_by_the_proxy_and_retried(
    s3: S3Server, fault_proxy: FaultProxy
) -> None:
    s3.put_objects(BUCKET, {"train-0001.tar": DATA, "train-0002.tar": DATA})
    s3.clear_requests()
    fault_proxy.add_fault("status:503", times=1, method="GET", path_contains="train-0001")
    fs = _fs(s3, fault_proxy)
    assert fs.cat_file(f"{BUCKET}/train-0002.tar") == DATA  # does not match the rule
    assert fault_proxy.faults_injected() == 0
    assert fs.cat_file(f"{BUCKET}/train-0001.tar") == DATA  # botocore retried the 503
    assert fault_proxy.faults_injected("status:503") == 1
    assert s3.count("GET", BUCKET, "train-0001.tar") == 1  # the 503 never reached moto

    fault_proxy.add_fault("status:500", times=None, method="GET")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        _no_retry_client(s3, fault_proxy).get_object(Bucket=BUCKET, Key="train-0001.tar")
    assert info.value.response["Error"]["Code"] == "InternalError"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500


@pytest.mark.timeout(20)
def test_status_fault_on_head_maps_to_not_found(s3: S3Server, fault_proxy: FaultProxy) -> None:
    s3.put_objects(BUCKET, {"a.bin": DATA})
    fault_proxy.add_fault("status:404", times=1, method="HEAD")
    with pytest.raises(FileNotFoundError):
        _fs(s3, fault_proxy, attempts=1).info(f"{BUCKET}/a.bin")
    assert fault_proxy.stats().injected[0].method == "HEAD"


@pytest.mark.timeout(20)
def test_reset_fault_is_a_connection_error(s3: S3Server, fault_proxy: FaultProxy) -> None:
    s3.put_objects(BUCKET, {"a.bin": DATA})
    fault_proxy.add_fault("reset", times=1, method="GET")
    with pytest.raises((botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError)):
        _no_retry_client(s3, fault_proxy).get_object(Bucket=BUCKET, Key="a.bin")
    assert fault_proxy.faults_injected("reset") == 1
    # With its default retries s3fs (botocore) recovers from a single reset.
    fault_proxy.add_fault("reset", times=1, method="GET")
    assert _fs(s3, fault_proxy).cat_file(f"{BUCKET}/a.bin") == DATA
    assert fault_proxy.faults_injected("reset") == 2


@pytest.mark.timeout(20)
def test_truncate_fault_cuts_the_body(s3: S3Server, fault_proxy: FaultProxy) -> None:
    s3.put_objects(BUCKET, {"a.bin": DATA})
    fault_proxy.add_fault("truncate", times=1, method="GET")
    body = _no_retry_client(s3, fault_proxy).get_object(Bucket=BUCKET, Key="a.bin")["Body"]
    with pytest.raises(botocore.exceptions.BotoCoreError):  # ResponseStreamingError
        body.read()

    fault_proxy.add_fault("truncate", times=None, method="GET", truncate_bytes=1000)
    with pytest.raises(aiohttp.ClientPayloadError):
        _fs(s3, fault_proxy, attempts=1).cat_file(f"{BUCKET}/a.bin")
    fault_proxy.clear_faults()

    fault_proxy.add_fault("truncate", times=1, method="GET")
    assert _fs(s3, fault_proxy).cat_file(f"{BUCKET}/a.bin") == DATA  # s3fs retries
    assert fault_proxy.faults_injected("truncate") >= 3


@pytest.mark.timeout(20)
def test_corrupt_fault_inverts_one_body_byte(s3: S3Server, fault_proxy: FaultProxy) -> None:
    s3.put_objects(BUCKET, {"a.bin": DATA})
    # botocore would check the object's CRC32 itself: take the bytes as they arrive.
    client = _no_retry_client(s3, fault_proxy, response_checksum_validation="when_required")
    fault_proxy.add_fault("corrupt", times=1, method="GET", corrupt_at=1000)
    fault_proxy.add_fault("corrupt", times=1, method="GET")  # the middle byte
    for at in (1000, len(DATA) // 2):
        body = client.get_object(Bucket=BUCKET, Key="a.bin")["Body"].read()
        assert len(body) == len(DATA)
        assert [i for i in range(len(DATA)) if body[i] != DATA[i]] == [at]
        assert body[at] == DATA[at] ^ 0xFF
    assert client.get_object(Bucket=BUCKET, Key="a.bin")["Body"].read() == DATA
    assert fault_proxy.faults_injected("corrupt") == 2


@pytest.mark.timeout(20)
def test_hang_fault_times_out_a_client(s3: S3Server, fault_proxy: FaultProxy) -> None:
    s3.put_objects(BUCKET, {"a.bin": DATA})
    fault_proxy.add_fault("hang", times=1, method="GET")
    client = _no_retry_client(s3, fault_proxy, read_timeout=0.5, connect_timeout=2)
    with pytest.raises(botocore.exceptions.ReadTimeoutError):
        client.get_object(Bucket=BUCKET, Key="a.bin")
    assert fault_proxy.faults_injected("hang") == 1
    assert fault_proxy.stats().requests == 1  # the client's own timeout, no retry


@pytest.mark.timeout(20)
def test_stop_is_prompt_with_a_hung_connection(s3: S3Server) -> None:
    proxy = FaultProxy("127.0.0.1", s3.port).start()
    proxy.add_fault("hang", times=None)
    port = proxy.port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /infra/a.bin HTTP/1.1\r\nHost: x\r\n\r\n")
        proxy.wait_for_faults(1, "hang", timeout=10)
        # A hang ends only when the proxy stops: if stop() did not end it, the connection's
        # thread would still be running when stop() gives up (its timeout, 5 s).
        proxy.stop()
        assert sock.recv(1024) == b""  # the proxy closed the connection, sent nothing
    assert not [t for t in threading.enumerate() if t.name.endswith(f"-{port}")]
    proxy.stop()  # idempotent


def test_unknown_fault_kinds_are_rejected(fault_proxy: FaultProxy) -> None:
    for kind in ("status", "status:abc", "status:99", "explode", "reset:1"):
        with pytest.raises(ValueError):
            fault_proxy.add_fault(kind)
