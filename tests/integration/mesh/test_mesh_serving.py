"""The cache mesh's serving and fetching over real sockets on 127.0.0.1: a node's published
shards (fetched from moto by a real ShardCache) served by MeshServer, in a thread or in a
second process, and fetched with fetch_range; what is refused, and every wait bounded."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlencode

import pytest
from mesh_holder import BUCKET, JOB, LOADED, SECRET, Holder, peer_process

from shardcache import PeerFetchError
from shardcache._mesh.auth import HEADER, JobKey, Verifier
from shardcache._mesh.client import Bounds, Peer, fetch_range
from shardcache._mesh.served import ShardRequest
from shardcache._mesh.server import PATH, MeshServer


def _fetch(server: MeshServer, request: ShardRequest, **kw) -> tuple[bytes, object]:
    got = bytearray()
    answer = fetch_range(
        Peer("127.0.0.1", server.port), JobKey(SECRET, JOB), request, got.extend, **kw
    )
    return bytes(got), answer


def _raw(server: MeshServer, request: ShardRequest, headers: dict[str, str]) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        connection.request("GET", f"{PATH}?{urlencode(request.query())}", headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_peer_serves_a_published_shard_whole_and_by_range(holder, server) -> None:
    url = f"s3://{BUCKET}/a.tar"
    blob, request = holder.blobs[url], holder.requests[url]
    whole, answer = _fetch(server, request)
    assert whole == blob
    assert answer.size == len(blob) and answer.record["checksum"] is not None
    assert answer.record["etag"] and answer.record["size"] == len(blob)
    part, answer = _fetch(server, request, start=1000, end=1_500_999)
    assert part == blob[1000:1_501_000] and answer.start == 1000
    tail, _ = _fetch(server, request, start=len(blob) - 10)
    assert tail == blob[-10:]
    assert server.wait_idle(5)  # a transfer's counts are final once it ends
    counts = server.counts()
    assert counts["200"] == 1 and counts["206"] == 2
    assert counts["bytes"] == len(blob) + 1_500_000 + 10
    assert counts["connections"] == 1  # the thread kept its connection for the next request


def test_a_kept_connection_the_peer_closed_is_replaced_and_a_forked_child_makes_its_own(
    holder,
) -> None:
    """A server stopped after an answer closes the connection the client kept; a new
    server on the same port answers the next request on a new connection, with no failure.
    A forked child asks on a connection of its own, never on its parent's socket."""
    url = f"s3://{BUCKET}/b.tar"
    verifier = Verifier(JobKey(SECRET, JOB))
    with MeshServer(holder.shards(), verifier, "127.0.0.1") as first:
        assert _fetch(first, holder.requests[url])[0] == holder.blobs[url]
        port = first.port
    with MeshServer(holder.shards(), verifier, "127.0.0.1", port=port) as second:
        assert _fetch(second, holder.requests[url])[0] == holder.blobs[url]
        child = os.fork()
        if child == 0:  # the child's fetch, then its exit status says whether it got the bytes
            try:
                ok = _fetch(second, holder.requests[url])[0] == holder.blobs[url]
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _fetch(second, holder.requests[url])[0] == holder.blobs[url]  # the kept one
        assert second.wait_idle(5)
        counts = second.counts()
    assert (counts["200"], counts["connections"]) == (3, 2), counts


def test_requests_without_the_job_key_are_refused(holder, server) -> None:
    request = holder.requests[f"s3://{BUCKET}/b.tar"]
    target = f"{PATH}?{urlencode(request.query())}"
    assert _raw(server, request, {}) == 401
    assert _raw(server, request, {HEADER: JobKey(b"x" * 32, JOB).sign("GET", target)}) == 403
    assert _raw(server, request, {HEADER: JobKey(SECRET, "other-job").sign("GET", target)}) == 403
    signed = JobKey(SECRET, JOB).sign("GET", target, "bytes=0-9")
    assert _raw(server, request, {HEADER: signed, "Range": "bytes=0-99999"}) == 403  # range changed
    assert _raw(server, request, {HEADER: signed, "Range": "bytes=0-9"}) == 206
    assert _raw(server, request, {HEADER: signed, "Range": "bytes=0-9"}) == 403  # replayed
    assert server.wait_idle(5)  # a transfer's counts are final once it ends
    counts = server.counts()
    assert (counts["401"], counts["403"], counts["206"], counts.get("bytes")) == (1, 4, 1, 10)


def _refused(server: MeshServer, request: ShardRequest) -> int | None:
    with pytest.raises(PeerFetchError) as failed:
        _fetch(server, request)
    assert failed.value.peer == f"127.0.0.1:{server.port}"
    return failed.value.status


def test_only_published_copies_of_the_jobs_dataset_are_served(holder, server, tmp_path) -> None:
    inside = holder.requests[f"s3://{BUCKET}/b.tar"]
    outside = holder.requests[f"s3://{BUCKET}/outside.tar"]
    assert _refused(server, outside) == 404  # published here, not the job's dataset
    never = ShardRequest("node", inside.protocol, inside.namespace, f"s3://{BUCKET}/missing.tar")
    holder.allowed.add((never.url, never.namespace))
    assert _refused(server, never) == 404  # the job's, not held here
    for scope in ("../node", "rank-0", "node/../node"):
        assert _refused(server, ShardRequest(scope, *list(inside.query().values())[1:])) == 404
    aliased = ShardRequest("node", inside.protocol, inside.namespace, inside.url + "/../b.tar")
    holder.allowed.add((aliased.url, aliased.namespace))
    assert _refused(server, aliased) == 404  # another spelling never reaches another file
    local = tmp_path / "local.tar"
    local.write_bytes(b"x" * 100)
    file_request = ShardRequest("node", "file", "", f"file://{local}")
    holder.allowed.add((file_request.url, ""))
    assert _refused(server, file_request) == 404
    assert _fetch(server, inside)[0] == holder.blobs[f"s3://{BUCKET}/b.tar"]


def test_a_copy_its_record_does_not_describe_is_not_served(holder, server) -> None:
    url = f"s3://{BUCKET}/b.tar"
    path = holder.cache.path_for(url)
    copy = path.with_name("copy")
    copy.write_bytes(path.read_bytes())  # same bytes, another inode: the record is not its own
    os.replace(copy, path)
    assert _refused(server, holder.requests[url]) == 404
    path.unlink()
    os.symlink(holder.cache.path_for(f"s3://{BUCKET}/a.tar"), path)  # a link in its place
    assert _refused(server, holder.requests[url]) == 404
    assert server.wait_idle(5)
    assert server.counts()["404"] == 2


def test_a_range_outside_the_copy_is_416(holder, server) -> None:
    url = f"s3://{BUCKET}/b.tar"
    with pytest.raises(PeerFetchError) as failed:
        _fetch(server, holder.requests[url], start=len(holder.blobs[url]))
    assert failed.value.status == 416


@pytest.fixture
def peer(holder: Holder) -> Iterator[tuple[subprocess.Popen[str], int]]:
    with peer_process(holder, rate=4e6) as running:
        yield running


def test_a_second_process_serves_and_a_sigkill_mid_transfer_is_bounded(holder, peer):
    proc, port = peer
    url = f"s3://{BUCKET}/a.tar"
    got = bytearray()
    peer, key = Peer("127.0.0.1", port), JobKey(SECRET, JOB)
    fetch_range(peer, key, holder.requests[url], got.extend)
    assert bytes(got) == holder.blobs[url]

    def kill_after_first_piece(piece: memoryview) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    started = time.monotonic()
    with pytest.raises(PeerFetchError, match="did not give") as failed:
        fetch_range(
            peer, key, holder.requests[url], kill_after_first_piece, bounds=Bounds(chunk=65536)
        )
    assert time.monotonic() - started < 2.0 + LOADED  # the bound (2 s); the reset is at once
    assert failed.value.status == 200  # it broke off after the answer had begun
    started = time.monotonic()
    with pytest.raises(PeerFetchError, match="no answer"):
        fetch_range(peer, key, holder.requests[url], got.extend)  # nobody listens now
    assert time.monotonic() - started < 2.0 + LOADED


def test_a_peer_that_never_answers_is_given_up_within_the_bound(holder) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        peer = Peer("127.0.0.1", silent.getsockname()[1])
        started = time.monotonic()
        with pytest.raises(PeerFetchError, match=r"no answer within 0\.3 s") as failed:
            fetch_range(
                peer,
                JobKey(SECRET, JOB),
                holder.requests[f"s3://{BUCKET}/b.tar"],
                lambda piece: None,
                bounds=Bounds(timeout=0.3),
            )
        assert 0.3 <= time.monotonic() - started < 0.3 + LOADED
        assert isinstance(failed.value.cause, TimeoutError)
        assert failed.value.status is None


def test_a_trickling_peer_is_given_up_at_the_total_deadline(holder) -> None:
    shards, verifier = holder.shards(), Verifier(JobKey(SECRET, JOB))
    url = f"s3://{BUCKET}/a.tar"  # 2.5 MB at 1 MB/s would take 2.5 s; the bound is 0.5 + 1.25
    with MeshServer(shards, verifier, "127.0.0.1", upload_rate=1e6) as slow:
        started = time.monotonic()
        with pytest.raises(PeerFetchError, match="within the deadline"):
            _fetch(slow, holder.requests[url], bounds=Bounds(timeout=0.5, min_rate=2e6))
        assert time.monotonic() - started < 1.75 + LOADED  # the deadline, and a loaded machine


def test_the_upload_cap_paces_and_the_concurrency_cap_answers_503(holder) -> None:
    shards, verifier = holder.shards(), Verifier(JobKey(SECRET, JOB))
    url = f"s3://{BUCKET}/a.tar"
    size = len(holder.blobs[url])
    with MeshServer(shards, verifier, "127.0.0.1", upload_rate=4e6, concurrency=1) as capped:
        first_piece, results = threading.Event(), {}

        def slow_fetch() -> None:
            got = bytearray()

            def sink(piece: memoryview) -> None:
                got.extend(piece)
                first_piece.set()

            started = time.monotonic()
            fetch_range(
                Peer("127.0.0.1", capped.port),
                JobKey(SECRET, JOB),
                holder.requests[url],
                sink,
                bounds=Bounds(min_rate=1e6),
            )
            results["seconds"], results["bytes"] = time.monotonic() - started, bytes(got)

        worker = threading.Thread(target=slow_fetch)
        worker.start()
        assert first_piece.wait(5)
        with pytest.raises(PeerFetchError) as busy:
            _fetch(capped, holder.requests[f"s3://{BUCKET}/b.tar"])
        assert busy.value.status == 503
        worker.join(10)
        assert results["bytes"] == holder.blobs[url]
        # 1 MiB passes at once (the burst), the rest at 4 MB/s
        assert results["seconds"] >= (size - (1 << 20)) / 4e6 * 0.9
        assert capped.wait_idle(5)  # a transfer's counts are final once it ends
        counts = capped.counts()
        assert counts["503"] == 1 and counts["200"] == 1 and counts["throttled_ms"] > 0
