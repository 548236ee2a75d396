"""A cache's miss filled from a peer of the cache mesh, in the miss path, before the store:
a holder process serves its published shards, a second cache (its own directory, the same
store behind the fault proxy, whose request counts are the store's) fills its misses from
it. The store sees no GET for a shard a peer gave; a flipped byte in the holder's copy and a
holder SIGKILLed mid-transfer each fall back to the store within a bound, the peer named,
the damaged bytes never delivered; the fills are counted as ``peer`` in the stats, the loader
report and Prometheus."""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import random
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import pytest
from awscrt import checksums as crt_checksums
from mesh_holder import JOB, LOADED, SECRET, WIDE, Copies, Holder, Known, peer_process
from prometheus_client.parser import text_string_to_metric_families

import shardcache
from shardcache import ShardCache
from shardcache._cli.main import main
from shardcache._disk.metadata import read_meta
from shardcache._mesh.auth import JobKey
from shardcache._mesh.client import Bounds, Peer
from shardcache._mesh.holders import Holding, PeerSource
from shardcache._mesh.verify import Expected, verified_by

BUCKET = "meshmiss"
SIZES = {"a.tar": 2_500_000, "b.tar": 300_000, "c.tar": 200_000}


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


@pytest.fixture
def holder(s3, fault_proxy, tmp_path: Path) -> Holder:
    """A node's cache holding every shard, fetched through the fault proxy (so its shards'
    identity, the store's endpoint among it, is the receiver's)."""
    objects = {k: random.Random(k).randbytes(n) for k, n in SIZES.items()}
    s3.put_objects(BUCKET, objects)
    options = s3.storage_options(fault_proxy.endpoint_url)
    cache = ShardCache(tmp_path / "holder", scope="node", storage_options=options)
    blobs = {_url(k): v for k, v in objects.items()}
    for url in blobs:
        cache.fetch(url)
    return Holder(cache, blobs, list(blobs))


def _receiver(
    holder: Holder,
    port: int,
    tmp_path: Path,
    fault_proxy,
    s3,
    *,
    before: tuple[Holding, ...] = (),
    known_urls: bool = True,
    **bounds: float,
) -> ShardCache:
    """A second node's cache whose misses ask ``before``, then ``holder``'s server on
    ``port``, before the store; what each shard is known to be comes from the holder's
    records (a dataset lock's entries), or nothing is known (``known_urls=False``). The
    peers' bound is wide (the tests count the store's GETs) unless ``bounds`` say."""
    known = []
    for url in holder.blobs if known_urls else ():
        shard = holder.cache._identify(url)
        record = read_meta(holder.cache.layout, shard.data_path)
        expected = Expected(record["size"], record["etag"], record["version_id"])
        known.append((shard.canonical_url, expected))
    source = PeerSource(
        JobKey(SECRET, JOB),
        Copies((*before, Holding(Peer("127.0.0.1", port), "node"))),
        Known(tuple(known)),
        Bounds(**{"timeout": WIDE, **bounds}),
    )
    cache = ShardCache(
        tmp_path / "receiver",
        scope="node",
        storage_options=s3.storage_options(fault_proxy.endpoint_url),
        metrics=str(tmp_path / "metrics"),
    )
    cache._attach_peers(source)  # what a dataset in the mesh does (_datasets.mesh_wiring)
    return cache


def _store_gets(fault_proxy, name: str) -> int:
    """GETs of ``name`` the store's side (the proxy in front of it) has seen."""
    return fault_proxy.requests_seen()[("GET", f"/{BUCKET}/{name}")]


@pytest.fixture
def served(holder: Holder) -> Iterator[tuple[Popen[str], int]]:
    with peer_process(holder) as running:
        yield running


def test_a_miss_is_filled_from_the_holder_with_no_get_to_the_store(
    holder, served, tmp_path, fault_proxy, s3, caplog, capsys
) -> None:
    _proc, port = served
    shardcache.log_epoch_summary(0)  # the holder's epoch (one process plays both nodes)
    receiver = _receiver(holder, port, tmp_path, fault_proxy, s3)
    gets_before = {name: _store_gets(fault_proxy, name) for name in SIZES}
    assert gets_before == dict.fromkeys(SIZES, 1)  # the holder's downloads
    with shardcache.PrometheusSink(port=0) as sink:
        shardcache.add_metrics_sink(sink)
        path = receiver.fetch(_url("a.tar"))
        # a DataLoader worker's copy of the cache fills from the peer too
        path_b = pickle.loads(pickle.dumps(receiver)).fetch(_url("b.tar"))
        with receiver.open(_url("c.tar")) as opened:  # the prefetcher's streaming path
            assert opened.read() == holder.blobs[_url("c.tar")]
        with caplog.at_level(logging.INFO, logger="shardcache"):
            report = shardcache.log_epoch_summary(0)
        with urllib.request.urlopen(sink.url, timeout=30) as response:
            scrape = response.read().decode()

    assert path.read_bytes() == holder.blobs[_url("a.tar")]
    assert path_b.read_bytes() == holder.blobs[_url("b.tar")]
    assert {name: _store_gets(fault_proxy, name) for name in SIZES} == gets_before
    stats = receiver.stats()
    assert (stats.from_peers, stats.misses, stats.hits) == (2, 0, 0)
    assert stats.bytes_from_peers == SIZES["a.tar"] + SIZES["c.tar"]
    assert stats.bytes_downloaded == 0
    # The receiver's record names the checksum the holder's was verified by: it can serve on.
    mine = read_meta(receiver.layout, path)
    theirs = read_meta(holder.cache.layout, holder.cache.path_for(_url("a.tar")))
    assert verified_by(mine) == verified_by(theirs) is not None
    assert (mine["etag"], mine["size"]) == (theirs["etag"], theirs["size"])

    assert (report["from_peers"], report["misses"]) == (3, 0)
    assert report["bytes_from_peers"] == sum(SIZES.values())
    assert "0 misses, 0 shared, 3 from peers (3.0 MB)" in caplog.text
    fetches = {
        s.labels["result"]: s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
        if s.name == "shardcache_fetches_total"
    }
    assert fetches == {"hit": 0, "miss": 0, "shared": 0, "peer": 3}
    peer_bytes = [
        s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
        if s.name == "shardcache_peer_bytes_total"
    ]
    assert peer_bytes == [sum(SIZES.values())]

    assert main(["report", str(tmp_path / "metrics"), "--json"]) == 0
    [job] = json.loads(capsys.readouterr().out)["jobs"]
    assert (job["total"]["from_peers"], job["total"]["misses"]) == (3, 0)
    assert job["total"]["bytes_from_peers"] == sum(SIZES.values())
    assert main(["report", str(tmp_path / "metrics")]) == 0
    assert "from peers of the cache mesh: 3 shards (3.0 MB), 0 peers failed" in (
        capsys.readouterr().out
    )


def test_a_flipped_byte_in_the_holders_copy_is_caught_named_and_fetched_from_the_store(
    holder, served, tmp_path, fault_proxy, s3, caplog
) -> None:
    _proc, port = served
    path = holder.cache.path_for(_url("b.tar"))
    with open(path, "r+b") as copy:  # bit rot in place: the record still describes the file
        copy.seek(100_000)
        byte = copy.read(1)
        copy.seek(100_000)
        copy.write(bytes([byte[0] ^ 0x40]))
    receiver = _receiver(holder, port, tmp_path, fault_proxy, s3)
    shardcache.log_epoch_summary(0)  # the holder's epoch
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        got = receiver.fetch(_url("b.tar"))
    assert got.read_bytes() == holder.blobs[_url("b.tar")]  # the store's, never the damaged copy
    assert _store_gets(fault_proxy, "b.tar") == 2  # the holder's download, then this one
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"peer 127.0.0.1:{port} failed" in m and "b.tar" in m for m in warned), warned
    stats = receiver.stats()
    assert (stats.peer_fallbacks, stats.peer_corruptions) == (1, 1)
    assert (stats.misses, stats.from_peers) == (1, 0)
    report = shardcache.log_epoch_summary(1)
    assert (report["peer_fallbacks"], report["peer_corruptions"]) == (1, 1)


def test_a_holder_sigkilled_mid_transfer_falls_back_to_the_store_within_the_bound(
    holder, tmp_path, fault_proxy, s3
) -> None:
    with peer_process(holder, rate=4e6) as (proc, port):  # 2.5 MB at 4 MB/s: 0.6 s to send
        receiver = _receiver(holder, port, tmp_path, fault_proxy, s3, timeout=2.0, chunk=65536)

        def kill_at_first_bytes(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
            if phase == "from peer" and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)

        started = time.monotonic()
        got = receiver.fetch(_url("a.tar"), progress=kill_at_first_bytes)
        took = time.monotonic() - started
        assert proc.returncode == -signal.SIGKILL
    assert got.read_bytes() == holder.blobs[_url("a.tar")]
    assert took < 2.0 + LOADED  # the reset ends the wait at once; then the store's download
    assert _store_gets(fault_proxy, "a.tar") == 2
    stats = receiver.stats()
    assert (stats.peer_fallbacks, stats.misses, stats.from_peers) == (1, 1, 0)
    # The dead peer is put aside: the next miss goes to the store without asking it.
    receiver.fetch(_url("c.tar"))
    assert receiver.stats().peer_fallbacks == 1
    assert _store_gets(fault_proxy, "c.tar") == 2


def test_the_next_holder_is_asked_after_one_that_does_not_answer(
    holder, served, tmp_path, fault_proxy, s3, caplog
) -> None:
    _proc, port = served
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        dead = Holding(Peer("127.0.0.1", silent.getsockname()[1]), "node")
        # A tight bound (the live holder, idle, answers well within it even on a loaded
        # machine), far below the wide one the GET-counting tests use.
        receiver = _receiver(holder, port, tmp_path, fault_proxy, s3, before=(dead,), timeout=1)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="shardcache"):
            got = receiver.fetch(_url("b.tar"))
        assert time.monotonic() - started < 2 * 1 + LOADED  # the silent one's bound, the next
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m for m in warned if f":{dead.peer.port} failed" in m and "no answer within 1 s" in m]
    assert got.read_bytes() == holder.blobs[_url("b.tar")]
    assert _store_gets(fault_proxy, "b.tar") == 1  # the holder's download only
    stats = receiver.stats()
    assert (stats.peer_fallbacks, stats.from_peers, stats.misses) == (1, 1, 0)


def test_without_an_expected_identity_no_peer_is_asked(
    holder, served, tmp_path, fault_proxy, s3
) -> None:
    _proc, port = served
    receiver = _receiver(holder, port, tmp_path, fault_proxy, s3, known_urls=False)
    got = receiver.fetch(_url("b.tar"))  # a copy could be of another version: the store's
    assert got.read_bytes() == holder.blobs[_url("b.tar")]
    assert _store_gets(fault_proxy, "b.tar") == 2
    stats = receiver.stats()
    assert (stats.from_peers, stats.peer_fallbacks, stats.misses) == (0, 0, 1)


PART = 64 * 1024
SIZE_ONLY_HEADERS = {  # as SSE-KMS answers: no checksum, an ETag that is no MD5
    "ETag": '"0123456789abcdef0123456789abcdef"',
    "x-amz-server-side-encryption": "aws:kms",
}


def _crc32c(data: bytes) -> str:
    return base64.b64encode(crt_checksums.crc32c(data).to_bytes(4, "big")).decode()


def test_every_download_records_a_crc32c_that_peers_check_a_size_only_shard_by(
    s3, fault_proxy, tmp_path
) -> None:
    """The holder's downloads, by one stream (of an object its store vouches for by size
    only, as SSE-KMS; of one cut off and resumed at its byte) and by parallel ranges (one
    cut off and resumed), record the CRC32C of their bytes as they land; a peer checks its
    copy against it, and a flipped byte is caught."""
    objects = {
        "kms.tar": random.Random(1).randbytes(200_000),
        "resumed.tar": random.Random(3).randbytes(250_000),
        "parallel.tar": random.Random(2).randbytes(5 * PART + 123),
    }
    s3.put_objects(BUCKET, {})
    plain = s3.boto3_client(request_checksum_calculation="when_required")
    for key, data in objects.items():
        plain.put_object(Bucket=BUCKET, Key=key, Body=data)
    # (not the parallel one: its ranged GETs' If-Match would carry the rewritten ETag)
    fault_proxy.add_fault(
        "headers", times=None, path_contains="kms.tar", set_headers=SIZE_ONLY_HEADERS
    )
    for key in ("resumed.tar", "parallel.tar"):  # the first GET's body cut short
        fault_proxy.add_fault("truncate", times=1, path_contains=key, truncate_bytes=50_000)
    cache = ShardCache(
        tmp_path / "holder",
        scope="node",
        storage_options=s3.storage_options(fault_proxy.endpoint_url),
        part_size=PART,
        parallel_threshold=300_000,
    )
    urls = {_url(k): v for k, v in objects.items()}
    for url in urls:
        cache.fetch(url)
    holder = Holder(cache, urls, list(urls))
    verified = {}
    for url, data in urls.items():
        record = read_meta(cache.layout, cache.path_for(url))
        verified[url] = record["verified"]
        assert record["mesh_crc32c"] == _crc32c(data)
    assert verified == {
        _url("kms.tar"): "size",
        _url("resumed.tar"): "md5",
        _url("parallel.tar"): "md5",
    }
    assert fault_proxy.faults_injected("truncate") == 2
    assert _store_gets(fault_proxy, "parallel.tar") > 2  # ranged GETs: the parallel path

    gets = {name: _store_gets(fault_proxy, name) for name in objects}
    with peer_process(holder) as (_proc, port):
        receiver = _receiver(holder, port, tmp_path, fault_proxy, s3)
        for url, data in urls.items():
            assert receiver.fetch(url).read_bytes() == data
        assert {name: _store_gets(fault_proxy, name) for name in objects} == gets
        assert receiver.stats().from_peers == 3
        mine = read_meta(receiver.layout, receiver.path_for(_url("kms.tar")))
        assert (mine["mesh_crc32c"], mine["verified"]) == (_crc32c(objects["kms.tar"]), "size")

        path = cache.path_for(_url("kms.tar"))
        with open(path, "r+b") as copy:  # bit rot in the size-only copy
            copy.seek(777)
            byte = copy.read(1)
            copy.seek(777)
            copy.write(bytes([byte[0] ^ 0x01]))
        other = _receiver(holder, port, tmp_path / "third", fault_proxy, s3)
        assert other.fetch(_url("kms.tar")).read_bytes() == objects["kms.tar"]
    assert _store_gets(fault_proxy, "kms.tar") == gets["kms.tar"] + 1
    assert (other.stats().peer_corruptions, other.stats().misses) == (1, 1)


def test_a_holder_without_the_copy_is_not_put_aside(
    holder, served, tmp_path, fault_proxy, s3
) -> None:
    _proc, port = served
    receiver = _receiver(holder, port, tmp_path, fault_proxy, s3)
    assert holder.cache.remove(holder.cache.path_for(_url("b.tar")))  # evicted since
    assert receiver.fetch(_url("b.tar")).read_bytes() == holder.blobs[_url("b.tar")]
    assert _store_gets(fault_proxy, "b.tar") == 2  # 404 from the peer: the store's copy
    assert receiver.fetch(_url("a.tar")).read_bytes() == holder.blobs[_url("a.tar")]
    assert _store_gets(fault_proxy, "a.tar") == 1  # the same peer asked again, and it gave
    stats = receiver.stats()
    assert (stats.peer_fallbacks, stats.misses, stats.from_peers) == (1, 1, 1)
