"""GCS (through the GCS emulator and gcsfs) and Azure Blob Storage (through Azurite and
adlfs), real servers on loopback: fetch verified by the store's own checksum (GCS: CRC32C;
Azure: Content-MD5), one cache entry per object whatever URL scheme names it, the
WebDataset stage, ``shardcache warm``, a missing object, a byte flipped in transit, an
object replaced during a download (never cached torn) and, on Azure, a wrong key."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tars import shard_samples, tar_bytes

import shardcache
from shardcache import IntegrityError, RemoteNotFoundError, RemotePermissionError, ShardCache
from shardcache._cache import shard_cache
from shardcache._disk.layout import is_temp_name
from shardcache._disk.metadata import read_meta
from shardcache._observe import metrics
from shardcache._ops.verify import verify
from shardcache._retry.throttle import Throttle
from shardcache.testing import AzuriteServer, FaultProxy, GcsEmulator

CHUNK = 256 * 1024  # each ranged GET of a download: a 1 MB object takes four


@dataclass
class Store:
    """One of the two stores as the tests use it: where its objects are and how to reach it."""

    server: GcsEmulator | AzuriteServer
    schemes: tuple[str, str]  # two spellings of the same store's URLs
    bucket: str
    algorithm: str  # what a download is verified by
    data_path: str  # what the path of a read of an object's bytes starts with

    def data_target(self, key: str) -> str:
        """The path of a read of ``key``'s bytes (not of its metadata)."""
        return f"{self.data_path}{key}"

    def data_read(self, method: str, target: str) -> bool:
        """Whether a request is a read of an object's bytes (not of its metadata)."""
        return method == "GET" and target.startswith(self.data_path)

    def url(self, key: str, scheme: int = 0) -> str:
        return f"{self.schemes[scheme]}://{self.bucket}/{key}"

    def put(self, objects: Mapping[str, bytes]) -> None:
        self.server.put_objects(self.bucket, objects)

    def cache(self, tmp_path: Path, proxy: FaultProxy | None = None, **kw: Any) -> ShardCache:
        endpoint = proxy.endpoint_url if proxy is not None else None
        kw.setdefault("retry_backoff", 0.01)
        kw.setdefault("chunk_size", CHUNK)
        return ShardCache(
            tmp_path / "cache", storage_options=self.server.storage_options(endpoint), **kw
        )


@pytest.fixture(params=["gcs", "azure"])
def store(request: pytest.FixtureRequest) -> Store:
    if request.param == "gcs":
        gcs = request.getfixturevalue("gcs")
        return Store(gcs, ("gs", "gcs"), "bkt", "crc32c", "/download/storage/v1/b/bkt/o/")
    azurite = request.getfixturevalue("azurite")
    return Store(azurite, ("abfs", "az"), "ctr", "md5", "/devstoreaccount1/ctr/")


@pytest.fixture
def proxy(store: Store) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", store.server.port) as made:
        yield made


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _nothing_published(cache: ShardCache, url: str) -> bool:
    files = [p for p in cache.settings.scope_dir.rglob("*") if p.is_file()]
    return not cache.contains(url) and not [p for p in files if is_temp_name(p.name)]


def _warm(store: Store, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``shardcache warm *args`` in a subprocess, its cache in ``tmp_path`` and ``store``'s
    options given through the environment."""
    env = {
        **os.environ,
        "SHARDCACHE_DIR": str(tmp_path / "cache"),
        "SHARDCACHE_STORAGE_OPTIONS": json.dumps(store.server.storage_options()),
    }
    return subprocess.run(
        [sys.executable, "-m", "shardcache", "warm", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_fetch_is_verified_by_the_stores_checksum_with_one_metadata_request(
    store: Store, proxy: FaultProxy, tmp_path: Path
) -> None:
    data = _blob(1_000_000, 1)
    store.put({"d/a.bin": data})
    cache = store.cache(tmp_path, proxy)

    path = cache.fetch(store.url("d/a.bin"))

    assert path.read_bytes() == data
    record = read_meta(cache.layout, path)
    assert record["verified"] == store.algorithm
    seen = proxy.requests_seen()
    data_reads = sum(n for (method, target), n in seen.items() if store.data_read(method, target))
    assert data_reads == 4, seen  # ranged GETs of CHUNK bytes
    assert sum(seen.values()) - data_reads == 1, seen  # the object's metadata, once
    # The other spelling of the same object is the same cache entry: a hit, no request.
    assert cache.fetch(store.url("d/a.bin", scheme=1)) == path
    assert sum(proxy.requests_seen().values()) == sum(seen.values())


def test_the_webdataset_stage_reads_a_tar_from_the_store(store: Store, tmp_path: Path) -> None:
    samples = shard_samples(0, 5)
    store.put({"train-0.tar": tar_bytes(samples)})
    cache = store.cache(tmp_path)

    url = store.url("train-0.tar")
    got = list(shardcache.WebDataset([url], shardshuffle=False, cache=cache))

    assert [s["__key__"] for s in got] == [key for key, _ in samples]
    assert [s["bin"] for s in got] == [files["bin"] for _, files in samples]
    assert read_meta(cache.layout, cache.path_for(url))["verified"] == store.algorithm


def test_warm_fetches_the_stores_shards(store: Store, tmp_path: Path) -> None:
    objects = {f"w/train-{i}.tar": _blob(30_000 + i, i) for i in range(3)}
    store.put(objects)
    run = _warm(store, tmp_path, store.url("w/train-{0..2}.tar"))

    assert run.returncode == 0, run.stderr
    assert "3 of 3 shards ok, 0 failed" in run.stdout
    cache = ShardCache(tmp_path / "cache", storage_options=store.server.storage_options())
    for key, data in objects.items():
        path = cache.path_for(store.url(key))
        assert path.read_bytes() == data
        assert read_meta(cache.layout, path)["verified"] == store.algorithm


def test_a_missing_object_is_remote_not_found_after_one_request(
    store: Store, proxy: FaultProxy, tmp_path: Path
) -> None:
    store.put({"present.bin": b"x"})
    cache = store.cache(tmp_path, proxy)
    url = store.url("absent.bin")

    with pytest.raises(RemoteNotFoundError, match=url):
        cache.fetch(url)

    assert _nothing_published(cache, url)
    # No listing: the object's metadata, and on GCS the bucket's (gcsfs raises the same
    # error for both; a missing bucket stops a warm at once).
    expected = 2 if "gs" in store.schemes else 1
    assert sum(proxy.requests_seen().values()) == expected, proxy.requests_seen()


def test_a_missing_bucket_stops_warm_at_once_naming_it(store: Store, tmp_path: Path) -> None:
    store.put({"present.bin": b"x"})  # the store answers; only this bucket is missing
    missing = [f"{store.schemes[0]}://nobucket/train-{i}.tar" for i in range(40)]
    run = _warm(store, tmp_path, *missing, "--threads", "2", "--json")

    assert run.returncode == 1, run.stderr
    report = json.loads(run.stdout)
    assert len(report["failed"]) <= 3, report  # the first, and what was in flight beside it
    assert report["not_attempted"] == 40 - len(report["failed"])
    assert report["stopped"].startswith("RemoteNotFoundError is about the store, not one shard")
    for failure in report["failed"]:
        assert "the bucket 'nobucket' does not exist at " in failure["error"], failure
        assert "failed at once, without retries" in failure["error"], failure


def test_the_gcs_bucket_check_takes_a_throttle_slot_and_is_counted(
    gcs: GcsEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing object on GCS costs two requests (its metadata, then its bucket's): each
    waits for its slot of the process's throttle and each is counted in the metrics."""
    gcs.put_objects("bkt", {"present.bin": b"x"})
    slept: list[float] = []  # one wait per slot: the clock stands still until a request waits
    now = [100.0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    throttle = Throttle(1.0, clock=lambda: now[0], sleep=sleep)
    monkeypatch.setattr(shard_cache, "process_throttle", lambda *caps: throttle)
    with FaultProxy("127.0.0.1", gcs.port) as proxy:
        cache = ShardCache(
            tmp_path / "cache", storage_options=gcs.storage_options(proxy.endpoint_url)
        )
        with pytest.raises(RemoteNotFoundError):
            cache.fetch("gs://bkt/absent.bin")
        seen = sum(proxy.requests_seen().values())

    assert seen == 2, proxy.requests_seen()
    assert len(slept) == seen
    assert metrics.end_epoch()["requests"] == {"HEAD": seen}


def test_a_byte_flipped_in_transit_is_an_integrity_error_and_nothing_is_published(
    store: Store, proxy: FaultProxy, tmp_path: Path
) -> None:
    store.put({"flip.bin": _blob(600_000, 2)})
    cache = store.cache(tmp_path, proxy, retries=1)
    url = store.url("flip.bin")
    proxy.add_fault(
        "corrupt", times=None, method="GET", path_contains=store.data_target("flip.bin")
    )

    with pytest.raises(IntegrityError) as caught:
        cache.fetch(url)

    assert url in str(caught.value)
    assert store.algorithm.upper() in str(caught.value)
    assert caught.value.details["algorithm"] == store.algorithm
    assert _nothing_published(cache, url)


def test_an_object_replaced_during_a_download_is_never_cached_torn(
    store: Store, proxy: FaultProxy, tmp_path: Path
) -> None:
    old, new = _blob(1_000_000, 3), _blob(1_000_000, 4)  # the same size
    old_generation = store.server.put_objects(store.bucket, {"moving.bin": old})["moving.bin"]
    cache = store.cache(tmp_path, proxy)
    url = store.url("moving.bin")
    held = proxy.add_fault(
        "hold", times=1, method="GET", path_contains=store.data_target("moving.bin")
    )
    result: dict[str, Any] = {}

    def fetch() -> None:
        try:
            result["path"] = cache.fetch(url)
        except Exception as exc:  # raised in the test's thread below
            result["error"] = exc

    thread = threading.Thread(target=fetch)
    thread.start()
    try:
        proxy.wait_for_faults(1, "hold", timeout=30)  # the first read is half way
        store.put({"moving.bin": new})
    finally:
        held.release()
        thread.join(timeout=60)
    assert not thread.is_alive()

    assert "error" not in result, result.get("error")
    assert result["path"].read_bytes() == new  # the new object, whole: never old and new mixed
    if isinstance(store.server, GcsEmulator):
        # The held read named the generation seen first (the emulator ignores it: there the
        # CRC32C caught the mix); the record holds the new object's.
        first_read = proxy.stats().injected[0].target
        assert f"generation={old_generation}" in first_read
        assert read_meta(cache.layout, result["path"])["version_id"] != old_generation


def test_a_wrong_azure_key_is_a_permission_error_on_one_line(
    azurite: AzuriteServer, tmp_path: Path
) -> None:
    azurite.put_objects("ctr", {"a.bin": b"abc"})
    wrong = azurite.connection_string(key="A" * 86 + "==")
    cache = ShardCache(tmp_path / "cache", storage_options={"connection_string": wrong})

    with pytest.raises(RemotePermissionError) as caught:
        cache.fetch("az://ctr/a.bin")

    assert "az://ctr/a.bin" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_verify_checks_a_cached_copy_against_the_stores_checksum(
    store: Store, tmp_path: Path
) -> None:
    data = _blob(100_000, 5)
    store.put({"v.bin": data})
    cache = store.cache(tmp_path)
    path = cache.fetch(store.url("v.bin"))
    method = read_meta(cache.layout, path)["verified"]  # GCS: crc32c; Azure: md5
    assert not verify(cache).failed
    damaged = bytearray(data)  # a byte flipped on disk, the size kept
    damaged[50_000] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(damaged))

    report = verify(cache)

    [bad] = report.of("bad")
    assert bad.detail.startswith(f"{method} ") and bad.removed


def test_an_azure_blob_committed_from_blocks_without_an_md5_is_verified_by_its_size(
    azurite: AzuriteServer, tmp_path: Path
) -> None:
    """Azure keeps no whole-blob checksum of a blob committed from blocks (unless the
    uploader sets its Content-MD5): its size is all there is to check, and it says so."""
    data = _blob(300_000, 9)
    azurite.put_objects("ctr", {})  # the container
    blob = azurite.service_client().get_blob_client("ctr", "blocks.bin")
    ids = []
    for number, start in enumerate(range(0, len(data), 100_000)):
        ids.append(f"{number:08d}")
        blob.stage_block(ids[-1], data[start : start + 100_000])
    blob.commit_block_list(ids)
    assert blob.get_blob_properties().content_settings.content_md5 is None
    cache = ShardCache(tmp_path / "cache", storage_options=azurite.storage_options())
    path = cache.fetch("az://ctr/blocks.bin")
    assert path.read_bytes() == data
    assert read_meta(cache.layout, path)["verified"] == "size"
    assert cache.stats().verified == {"size": 1}
