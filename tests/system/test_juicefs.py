"""The JuiceFS test fixture (tools/juicefs.py) on real mounts: two mounts of one
volume act as two nodes (shared files, flock and os.link across them), a JuiceFS mount is
detected as a network file system (so lock_mode=auto takes leases there), and nothing is
left running."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from mounts import require_fuse

from shardcache import ShardCache
from shardcache._base.fsinfo import mount_for
from tools.juicefs import JuiceFSError, Node, _alive, _processes_with, format_volume, mounted


def test_two_mounts_share_files_flock_and_links(jfs_nodes: list[Node]) -> None:
    a, b = jfs_nodes
    (a.root / "hello").write_bytes(b"from a")
    assert (b.root / "hello").read_bytes() == b"from a"
    fd_a = os.open(a.root / "hello", os.O_RDONLY)
    fd_b = os.open(b.root / "hello", os.O_RDONLY)
    try:
        fcntl.flock(fd_a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd_b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd_a, fcntl.LOCK_UN)
        fcntl.flock(fd_b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd_a)
        os.close(fd_b)
    os.link(a.root / "hello", a.root / "lease")
    with pytest.raises(FileExistsError):
        os.link(b.root / "hello", b.root / "lease")
    counters = a.mount.stats()
    assert counters["juicefs_fuse_ops_total_lookup"] > 0, sorted(counters)[:20]


def test_a_juicefs_mount_is_a_network_file_system(jfs_nodes: list[Node]) -> None:
    node = jfs_nodes[0]
    mount = mount_for(node.root / "cache" / "node")
    assert mount.fstype == "fuse.juicefs" and mount.is_network, mount
    assert ShardCache(node.root / "cache")._locks.policy().mode == "lease"


def test_the_mount_is_gone_after_a_failing_block(tmp_path: Path) -> None:
    require_fuse()
    volume = format_volume(tmp_path / "vol")
    with pytest.raises(ZeroDivisionError), mounted(volume, tmp_path / "mnt") as mount:
        assert mount.pids and all(_alive(p) for p in mount.pids)
        (mount.mountpoint / "x").write_bytes(b"x")
        1 / 0  # noqa: B018
    assert not [p for p in mount.pids if _alive(p)]
    assert not _processes_with(str(mount.log))
    assert not os.path.ismount(tmp_path / "mnt")
    assert not (tmp_path / "mnt" / "x").exists()
    # The data stayed in the volume: mounted again, it is there.
    with mounted(volume, tmp_path / "mnt") as again:
        assert (again.mountpoint / "x").read_bytes() == b"x"


def test_a_failing_mount_says_why(tmp_path: Path) -> None:
    require_fuse()
    volume = format_volume(tmp_path / "vol")
    (tmp_path / "vol" / "meta.db").unlink()  # nothing to mount
    with pytest.raises(JuiceFSError, match="juicefs mount"), mounted(volume, tmp_path / "mnt"):
        pass
    assert not os.path.ismount(tmp_path / "mnt")
