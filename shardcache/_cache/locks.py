"""The locks a cache takes: its lock policy (``auto`` mode chosen from the scope's mount,
flock on local disks and a lease on network file systems), the node-local lock directory
of lease mode, and a :class:`~shardcache._locking.shard_lock.ShardLock` per shard that tells the
fetch's progress whom it waits for.

Invariant: one policy per cache, judged once from the mount of its scope directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._base.fsinfo import Mount, mount_for
from .._base.redact import get_logger
from .._base.safefs import SafeFS
from .._base.trust import Trust
from .._disk.layout import CacheLayout, ShardId
from .._locking.node_lock import node_lock_path, node_lock_root
from .._locking.policy import LockPolicy
from .._locking.shard_lock import ShardLock

if TYPE_CHECKING:
    from .._config.settings import Settings
    from .._transfer.download import Progress

logger = get_logger("shardcache._cache")  # the cache's records keep one logger name


class CacheLocks:
    """The shard locks of the scope laid out as ``layout``, configured by ``settings``;
    ``mount_for(path)`` tells which file system a path is on (``auto`` mode)."""

    def __init__(
        self,
        layout: CacheLayout,
        settings: Settings,
        *,
        mount_for: Callable[[Path], Mount] = mount_for,
    ) -> None:
        self._layout = layout
        self._settings = settings
        self._mount_for = mount_for
        self._policy: LockPolicy | None = None
        self._node_fs: SafeFS | None = None  # lease mode: the node-local lock directory

    def lock(self, shard: ShardId, progress: Progress | None) -> ShardLock:
        """The lock of ``shard``; while it waits, ``progress`` hears of the holder's."""

        def holder_progress(record: dict[str, Any] | None) -> None:
            if progress is None:
                return
            if record is None:  # the holder has not written its record yet
                progress(phase="waiting for the lock", bytes_done=0, bytes_total=None)
                return
            progress(
                phase=f"waiting for pid {record.get('pid')} on {record.get('host')}",
                bytes_done=int(record.get("bytes_done") or 0),
                bytes_total=record.get("bytes_total"),
            )

        policy = self.policy()
        node_fs = self.node_fs() if policy.mode == "lease" else None
        return ShardLock(
            shard.lock_path,
            url=shard.url,
            policy=policy,
            rank=self._settings.rank,
            on_wait=holder_progress,
            fs=self._layout.fs,
            node_lock=None if node_fs is None else node_lock_path(node_fs.root, shard.lock_path),
            node_fs=node_fs,
        )

    def policy(self) -> LockPolicy:
        """The cache's lock policy (SHARDCACHE_LOCK_MODE; ``auto`` by the scope's mount)."""
        if self._policy is None:
            s = self._settings
            mode = s.lock_mode
            mount = self._mount_for(s.scope_dir)
            if mount.is_network:
                logger.warning(
                    "shardcache directory %s is on a network file system (%s): a node-local "
                    "disk is much faster; set SHARDCACHE_DIR to one",
                    s.scope_dir,
                    mount.describe(),
                )
            if mode == "auto":
                mode = "lease" if mount.is_network else "flock"
            self._policy = LockPolicy(
                mode=mode,
                timeout=s.lock_timeout,
                stuck_after=s.lock_stuck_after,
                lease_time=s.lease_time,
            )
        return self._policy

    def node_fs(self) -> SafeFS | None:
        """Lease mode: the node-local directory of the node locks (None if turned off).
        Private to the user whatever the cache's group: it is this node's alone."""
        if self._node_fs is None:
            root = node_lock_root(self._settings.node_lock_dir, self._settings.scope_dir)
            if root is None:
                return None
            self._node_fs = SafeFS(root, Trust.private())
        return self._node_fs
