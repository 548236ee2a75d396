"""ShardCache on local sources: file systems, disk space, lock mode choice, the demo."""

from __future__ import annotations

import errno
import os
from collections import namedtuple
from pathlib import Path

import pytest

from shardcache import (
    CacheFullError,
    RemoteNotFoundError,
    Settings,
    ShardCache,
    UrlError,
    expand_urls,
)
from shardcache._base.fsinfo import mount_for, parse_mountinfo
from shardcache._cache.shard_cache import Wiring
from shardcache._cli.main import main
from shardcache._observe import metrics
from shardcache._ops.demo import DEMO_PORT, demo_port, run_demo
from shardcache._transfer.remote import Remote

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
90 27 0:50 / /shared rw,relatime - nfs4 filer:/export rw,vers=4.2,local_lock=none
91 90 0:51 / /shared/scratch rw - lustre 10.0.0.1@tcp:/fs rw,flock
92 27 0:52 / /mnt/with\\040space rw - tmpfs tmpfs rw
93 27 0:39 / /jfs rw,nosuid,nodev,relatime - fuse.juicefs JuiceFS:vol rw,user_id=0,group_id=0
"""


def test_mountinfo_parsing_and_network_detection() -> None:
    mounts = {m.mount_point: m for m in parse_mountinfo(MOUNTINFO)}
    assert mounts["/shared"].fstype == "nfs4" and mounts["/shared"].is_network
    assert "local_lock=none" in mounts["/shared"].options
    assert not mounts["/"].is_network
    assert "/mnt/with space" in mounts
    assert mounts["/jfs"].fstype == "fuse.juicefs" and mounts["/jfs"].is_network
    assert mount_for(Path("/shared/scratch/x/y"), MOUNTINFO).fstype == "lustre"
    assert mount_for(Path("/shared/x"), MOUNTINFO).fstype == "nfs4"
    assert mount_for(Path("/sharedother"), MOUNTINFO).fstype == "ext4"


def _source(tmp_path: Path, size: int = 100_000) -> tuple[str, bytes]:
    data = os.urandom(size)
    src = tmp_path / "src" / "shard-000000.tar"
    src.parent.mkdir()
    src.write_bytes(data)
    return str(src), data


def test_local_paths_and_file_urls_share_one_entry(tmp_path: Path) -> None:
    src, data = _source(tmp_path)
    cache = ShardCache(tmp_path / "cache")
    assert cache.fetch(src).read_bytes() == data
    assert cache.fetch(f"file://{src}") == cache.fetch(src)
    assert cache.stats().misses == 1


def test_a_fetch_that_delivers_nothing_counts_no_hit(tmp_path: Path) -> None:
    """count_hit=False (indexing a shard's samples): a cached copy is no hit, in the cache's
    stats and the loader metrics alike; a download is still a miss."""
    src, data = _source(tmp_path)
    cache = ShardCache(tmp_path / "cache")
    assert cache.fetch(src, count_hit=False).read_bytes() == data
    assert cache.fetch(src, count_hit=False) == cache.path_for(src)
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (1, 0)
    epoch = metrics.end_epoch()
    assert (epoch["misses"], epoch["hits"]) == (1, 0)
    cache.fetch(src)
    assert cache.stats().hits == 1


@pytest.mark.parametrize("url", ["s3:/bucket/x.tar", "s3:bucket/x.tar", "gs:/bucket/x.tar"])
def test_fetch_refuses_a_broken_scheme_as_expand_urls_does(url: str, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    with pytest.raises(UrlError) as expanded:
        expand_urls(url)
    for call in (cache.fetch, cache.open, cache.contains, cache.path_for):
        with pytest.raises(UrlError) as refused:
            call(url)
        assert str(refused.value) == str(expanded.value)
        assert refused.value.url == url
    assert "(it would be read as a local path)" in str(expanded.value)
    assert not (tmp_path / "cache").exists()


def test_fetch_still_takes_file_urls_of_one_slash(tmp_path: Path) -> None:
    src, data = _source(tmp_path)
    assert ShardCache(tmp_path / "cache").fetch(f"file:{src}").read_bytes() == data


def test_a_missing_local_file_gets_advice_about_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    cache = ShardCache(tmp_path / "cache")
    with pytest.raises(RemoteNotFoundError) as missing:
        cache.fetch("data/missing.tar")
    message = str(missing.value)
    assert message.endswith(
        f"Check the path (read as {tmp_path}/data/missing.tar) and that the file system is mounted."
    )
    assert "bucket" not in message
    assert main(["warm", "data/missing.tar", "--cache-dir", str(tmp_path / "cache")]) == 1
    out = capsys.readouterr().out
    assert "Check the path (read as " in out and "bucket" not in out


def test_auto_lock_mode_follows_the_file_system(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    network = parse_mountinfo(MOUNTINFO)[2]
    on_nfs = Wiring(mount_for=lambda path: network)
    cache = ShardCache._wired(Settings.resolve(cache_dir=tmp_path / "cache"), on_nfs)
    assert cache._locks.policy().mode == "lease"
    assert "network file system" in caplog.text
    forced = Settings.resolve(cache_dir=tmp_path / "cache", lock_mode="flock")
    assert ShardCache._wired(forced, on_nfs)._locks.policy().mode == "flock"


def test_not_enough_space_is_reported_before_downloading(tmp_path: Path) -> None:
    src, _ = _source(tmp_path)
    usage = namedtuple("usage", "total used free")
    full = Wiring(disk_usage=lambda p: usage(10**6, 10**6, 10))
    cache = ShardCache._wired(Settings.resolve(cache_dir=tmp_path / "cache"), full)
    with pytest.raises(CacheFullError) as info:
        cache.fetch(src)
    assert info.value.needed == 100_000 and info.value.free == 10
    assert "SHARDCACHE_DIR" in str(info.value) and src in str(info.value)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "data" in p.parts]


def test_disk_filling_up_mid_download_leaves_nothing(tmp_path: Path) -> None:
    src, _ = _source(tmp_path)

    class FillingTheDisk(Remote):
        def download(self, info, out, progress=None, opened=None):
            out.write(b"partial")
            out.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    settings = Settings.resolve(cache_dir=tmp_path / "cache")
    cache = ShardCache._wired(settings, Wiring(remote=FillingTheDisk))
    with pytest.raises(CacheFullError, match="disk filled up"):
        cache.fetch(src)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "data" in p.parts]


def test_demo_second_run_is_all_hits(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the demo's DataLoader (scripts/check-dist runs without)
    first = run_demo(cache_dir=tmp_path / "demo", shards=4)
    assert (first.shards, first.misses, first.hits, first.failed) == (4, 4, 0, [])
    assert first.samples == 4 * 32  # every sample through WebDataset + DataLoader
    second = run_demo(cache_dir=tmp_path / "demo", shards=4)
    assert (second.misses, second.hits, second.samples) == (0, 4, 4 * 32)
    assert second.bytes == first.bytes > 0
    assert second.endpoint == first.endpoint  # the port follows the cache directory


def test_demos_with_different_cache_dirs_use_different_ports() -> None:
    assert demo_port(Path("/data/a")) == demo_port(Path("/data/a"))
    assert demo_port(Path("/data/a")) != demo_port(Path("/data/b"))
    assert demo_port(None) == DEMO_PORT


@pytest.fixture
def http_dir(tmp_path: Path):
    import functools
    import http.server
    import threading

    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_http_urls_are_cached_and_verified_by_size(http_dir, tmp_path: Path) -> None:
    root, base = http_dir
    data = os.urandom(200_000)
    (root / "train-000000.tar").write_bytes(data)
    cache = ShardCache(tmp_path / "cache", retry_backoff=0.01)
    url = f"{base}/train-000000.tar"
    assert cache.fetch(url).read_bytes() == data
    assert cache.contains(url)
    with pytest.raises(RemoteNotFoundError, match=r"Check the URL \(and the endpoint"):
        cache.fetch(f"{base}/missing.tar")
