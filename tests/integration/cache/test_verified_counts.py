"""How each downloaded shard was verified, made visible: counted by method in the cache's
stats, the loader records, the rank's line, ``shardcache report`` and the Prometheus
scrape; a warning names a store whose objects are verified by their size only, once per
store and process. Against a real moto server behind the fault proxy, with objects as real
buckets hold them (a CRC32 checksum, a multipart upload's MD5 of MD5s, an encrypted object
whose ETag is no MD5 and that carries no checksum)."""

from __future__ import annotations

import json
import logging
import os
import random
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import shardcache
from shardcache import ShardCache
from shardcache._cache.size_only import published_by_size, store_name
from shardcache._cli.main import main
from shardcache._disk.layout import ShardId
from shardcache.testing._service import upload_multipart

PART = 64 * 1024
SIZE = 3 * PART - 500  # three parts, the last one short
NOT_AN_MD5 = '"0123456789abcdef0123456789abcdef"'
SIZE_ONLY_HEADERS = {"ETag": NOT_AN_MD5, "x-amz-server-side-encryption": "aws:kms"}


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _plain_client(s3: Any) -> Any:
    """A client that adds no checksum of its own: the object has its ETag only."""
    return s3.boto3_client(request_checksum_calculation="when_required")


def _size_only(s3: Any, fault_proxy: Any, bucket: str, key: str, seed: int) -> None:
    """An object as SSE-KMS stores it: no checksum, an ETag that is no MD5 (the proxy
    rewrites the store's headers of every answer about it)."""
    _plain_client(s3).put_object(Bucket=bucket, Key=key, Body=_blob(30_000, seed))
    fault_proxy.add_fault("headers", times=None, path_contains=key, set_headers=SIZE_ONLY_HEADERS)


@pytest.fixture
def objects(s3: Any, fault_proxy: Any) -> dict[str, str]:
    """URL -> the method a download of it is verified by."""
    s3.put_objects("vcounts", {"crc.tar": _blob(40_000, 1)})  # boto3 adds a CRC32
    upload_multipart(_plain_client(s3), "vcounts", "mp.tar", _blob(SIZE, 2), PART)
    _size_only(s3, fault_proxy, "vcounts", "kms.tar", 3)
    return {
        "s3://vcounts/crc.tar": "crc32",
        "s3://vcounts/mp.tar": "md5-parts",
        "s3://vcounts/kms.tar": "size",
    }


def _cache(tmp_path: Path, s3: Any, fault_proxy: Any, **kw: Any) -> ShardCache:
    return ShardCache(
        tmp_path / "cache",
        storage_options=s3.storage_options(fault_proxy.endpoint_url),
        part_size=PART,
        retry_backoff=0.01,
        **kw,
    )


def test_downloads_are_counted_by_method_in_stats_records_report_and_scrape(
    s3, fault_proxy, objects: dict[str, str], tmp_path: Path, capsys, caplog
) -> None:
    metrics_dir = tmp_path / "metrics"
    cache = _cache(tmp_path, s3, fault_proxy, metrics=str(metrics_dir))
    local = tmp_path / "local.tar"
    local.write_bytes(b"x" * 1000)
    records: list[dict] = []
    remove = shardcache.add_metrics_sink(records.append)
    with shardcache.PrometheusSink(port=0) as sink:
        shardcache.add_metrics_sink(sink)
        for url in [*objects, str(local)]:
            cache.fetch(url)
        for url in objects:  # hits: nothing downloaded, nothing counted again
            cache.fetch(url)
        with caplog.at_level(logging.INFO, logger="shardcache"):
            report = shardcache.log_epoch_summary(0)
        with urllib.request.urlopen(sink.url, timeout=30) as response:
            scrape = response.read().decode()
    remove()

    expected = {"crc32": 1, "md5-parts": 1, "size": 2}  # the local file: its size
    assert cache.stats().verified == expected
    assert cache.stats().as_dict()["verified"] == expected
    [epoch] = [r for r in records if r["kind"] == "epoch"]
    assert epoch["verified"] == expected and epoch["misses"] == 4
    assert report["verified"] == expected
    assert "4 misses" in caplog.text
    assert "downloaded (verified: size 2, crc32 1, md5-parts 1)" in caplog.text

    values = {
        (s.name, s.labels.get("method")): s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
        if s.name == "shardcache_shards_verified_total"
    }
    assert values == {
        ("shardcache_shards_verified_total", "crc32"): 1,
        ("shardcache_shards_verified_total", "md5-parts"): 1,
        ("shardcache_shards_verified_total", "size"): 2,
    }
    assert "s3://" not in scrape

    assert main(["report", str(metrics_dir), "--json"]) == 0
    [job] = json.loads(capsys.readouterr().out)["jobs"]
    assert job["total"]["verified"] == expected
    assert job["ranks"][0]["verified"] == expected
    assert main(["report", str(metrics_dir)]) == 0
    assert "downloads verified by: size 2, crc32 1, md5-parts 1" in capsys.readouterr().out


def _size_only_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "verified by their size only" in r.getMessage()
    ]


def test_a_store_verified_by_size_only_is_named_once_per_process(
    s3, fault_proxy, objects: dict[str, str], tmp_path: Path, caplog
) -> None:
    _size_only(s3, fault_proxy, "vcounts", "kms-2.tar", 4)
    s3.boto3_client().create_bucket(Bucket="other")
    _size_only(s3, fault_proxy, "other", "kms-3.tar", 5)
    local = tmp_path / "local.tar"
    local.write_bytes(b"x" * 1000)
    cache = _cache(tmp_path, s3, fault_proxy)
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        for url in objects:
            cache.fetch(url)
        cache.fetch("s3://vcounts/kms-2.tar")  # a second size-only shard of the same bucket
        cache.fetch(str(local))  # a local file: its size, but no store to name
        first = _size_only_warnings(caplog)
        cache.fetch("s3://other/kms-3.tar")
        again = ShardCache(tmp_path / "another", storage_options=cache.settings.storage_options)
        again.fetch("s3://vcounts/kms.tar")  # another cache of the same process: said already
    endpoint = fault_proxy.endpoint_url
    assert first == [
        f"objects from s3://vcounts at {endpoint} are verified by their size only: the store "
        "describes no checksum of them that shardcache can check (no full-object checksum, "
        "no MD5 ETag, no layout of a multipart upload's parts; first: s3://vcounts/kms.tar). A "
        "byte changed in transit would go unnoticed. Upload them with a checksum (e.g. aws "
        "s3 cp --checksum-algorithm CRC64NVME), or set SHARDCACHE_VERIFY=strict to refuse "
        "such objects. Said once per store and process; `shardcache status` counts the "
        "cached shards by how they were verified."
    ]
    warned = _size_only_warnings(caplog)
    assert len(warned) == 2
    assert warned[1].startswith(f"objects from s3://other at {endpoint} are verified")
    assert s3.secret_key not in caplog.text
    assert cache.stats().verified == {"crc32": 1, "md5-parts": 1, "size": 4}


def test_a_size_the_user_asked_for_is_counted_but_not_warned_about(
    s3, fault_proxy, objects: dict[str, str], tmp_path: Path, caplog
) -> None:
    cache = _cache(tmp_path, s3, fault_proxy, verify="size")
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        for url in objects:
            cache.fetch(url)
    assert cache.stats().verified == {"size": 3}
    assert _size_only_warnings(caplog) == []


@pytest.mark.parametrize(
    ("url", "namespace", "name"),
    [
        ("s3://b/k.tar", "s3@aws", "s3://b"),
        ("s3://b/k.tar", "s3@http://user:secret@127.0.0.1:9", "s3://b at http://***@127.0.0.1:9"),
        ("gs://b/d/k.tar", "gs", "gs://b"),
        ("https://user:secret@h.example/d/k.tar?X-Amz-Signature=sig", "https", "https://h.example"),
    ],
)
def test_a_store_is_named_without_credentials(url: str, namespace: str, name: str) -> None:
    protocol = url.split(":", 1)[0]
    shard = ShardId(url, protocol, url, namespace, Path("d"), Path("l"), Path("m"))
    assert store_name(shard) == name


def test_a_forked_child_does_not_repeat_what_its_parent_said(caplog) -> None:
    """A DataLoader worker forked after the training process warned about a store does not
    warn about it again; about another store it does."""
    said = ShardId("s3://b/k.tar", "s3", "s3://b/k.tar", "s3@aws", Path("d"), Path("l"), Path("m"))
    other = ShardId("gs://g/k.tar", "gs", "gs://g/k.tar", "gs", Path("d"), Path("l"), Path("m"))
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        published_by_size(said, "etag")
    assert len(_size_only_warnings(caplog)) == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it warns about, by the first word of each store
        try:
            warned: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda r: warned.append(r.getMessage().split()[2])  # type: ignore[method-assign]
            logging.getLogger("shardcache").addHandler(handler)
            published_by_size(said, "etag")
            published_by_size(other, "etag")
            os.write(write, json.dumps(warned).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        got = json.loads(answer.read())
    assert os.waitpid(pid, 0)[1] == 0
    assert got == ["gs://g"]
