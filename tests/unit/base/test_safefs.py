"""SafeFS remembers the directories near the root its walk checked: hits do not walk from
the root, and notice when a name no longer leads to the directory that was checked
(removed, swapped, chmodded)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest

from shardcache import CacheDirError, ShardCache
from shardcache._base import safefs
from shardcache._base.trust import Trust

pytestmark = pytest.mark.timeout(120)


def _fds_under(root: Path) -> int:
    """This process's descriptors open on ``root`` or below (other tests' threads may open
    and close unrelated descriptors meanwhile)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        count += target == str(root) or target.startswith(f"{root}/")
    return count


def _cached(tmp_path: Path) -> tuple[ShardCache, str, Path]:
    source = tmp_path / "shard.tar"
    source.write_bytes(b"the source's bytes" * 100)
    cache = ShardCache(tmp_path / "cache")
    return cache, str(source), cache.fetch(str(source))


def test_hits_do_not_walk_from_the_root(tmp_path: Path) -> None:
    cache, url, _path = _cached(tmp_path)
    walked = cache.layout.fs.root_walks
    assert walked > 0  # the miss did
    for _ in range(10):
        with cache.open(url) as f:
            assert f.read() == Path(url).read_bytes()
    assert cache.layout.fs.root_walks == walked
    assert cache.stats().hits == 10


def test_a_directory_removed_and_made_again_is_walked(tmp_path: Path) -> None:
    cache, url, path = _cached(tmp_path)
    data = path.parent.parent
    shutil.rmtree(data)
    data.mkdir(mode=0o700)  # a new directory (inode) at the remembered name
    with cache.open(url) as f:
        assert f.read() == Path(url).read_bytes()
    assert cache.layout.fs._dirs[str(data)][2] == data.stat().st_ino  # the new one
    assert cache.stats().misses == 2


@pytest.mark.parametrize("level", [1, 2], ids=["data-hh", "data"])
def test_a_directory_swapped_for_a_link_is_not_used(tmp_path: Path, level: int) -> None:
    cache, url, path = _cached(tmp_path)
    swapped = path.parents[level - 1]
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(swapped, elsewhere)  # the same layout, with foreign bytes in the shard
    planted = elsewhere / path.relative_to(swapped)
    planted.write_bytes(b"foreign bytes")
    swapped.rename(tmp_path / "aside")
    swapped.symlink_to(elsewhere)
    with pytest.raises(CacheDirError, match="expected a directory"):
        cache.fetch(url)
    assert planted.read_bytes() == b"foreign bytes"  # untouched


@pytest.mark.parametrize("level", [1, 2], ids=["data-hh", "data"])
def test_a_directory_made_writable_by_others_is_refused_on_the_next_hit(
    tmp_path: Path, level: int
) -> None:
    cache, url, path = _cached(tmp_path)
    path.parents[level - 1].chmod(0o777)
    with pytest.raises(CacheDirError, match="writable by no one else"):
        cache.fetch(url)


def test_the_remembered_descriptors_are_bounded_and_closed_with_their_safefs(
    tmp_path: Path,
) -> None:
    root = tmp_path / "cache"
    fs = safefs.SafeFS(root, Trust.private(), dir_memo=2)
    for scope in ("rank-0", "rank-1", "node"):
        for sub in ("data", ".meta", ".locks"):
            fs.mkdirs(root / scope / sub / "ab")
            fs.lstat(root / scope / sub / "ab")
    assert len(fs._dirs) == 2  # scope and scope/<sub> are remembered; at most dir_memo
    assert _fds_under(root) == 2
    del fs
    gc.collect()
    assert _fds_under(root) == 0


def _hit_in_child(cache: ShardCache, url: str, out) -> None:
    with cache.open(url) as f:
        out.put(f.read())


def test_a_forked_child_uses_the_remembered_directories(tmp_path: Path) -> None:
    cache, url, _path = _cached(tmp_path)
    with cache.open(url):
        pass
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_hit_in_child, args=(cache, url, out))
    child.start()
    assert out.get(timeout=60) == Path(url).read_bytes()
    child.join(60)
    assert child.exitcode == 0
