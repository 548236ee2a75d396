"""Where the node-local lock in front of a shard's lease lives.

In lease mode (a network file system) a process first takes a node-local ``flock`` for the shard, so
only one process per node contends for the lease on the shared file system; the others wait on the
local lock (see :class:`shardcache._locking.shard_lock.ShardLock`). The local lock files live on a
node-local disk, one directory per cache scope:

    <SHARDCACHE_NODE_LOCK_DIR>/<hash of the scope's real path>/<hh>/<hash64>.lock

(``<hh>/<hash64>.lock`` as in the scope's own ``.locks``). The default directory is
``<temp dir>/shardcache-<uid>/node-locks``: every process of a user on one node finds the
same one unless their ``TMPDIR`` differ, and then they merely contend for the lease
separately, as without a node lock. The scope is keyed by its real path, so the mounts of
one volume at different paths on different nodes, or a link to the scope, do not matter
for correctness: the lease still excludes across nodes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

OFF = "off"  # SHARDCACHE_NODE_LOCK_DIR=off: lease mode takes the lease directly


def default_node_lock_dir() -> Path:
    """``<temp dir>/shardcache-<uid>/node-locks`` (node-local, per user)."""
    return Path(tempfile.gettempdir()) / f"shardcache-{os.geteuid()}" / "node-locks"


def node_lock_root(setting: Path | str | None, scope_dir: Path) -> Path | None:
    """The node-lock directory of the scope ``scope_dir``; None if turned off."""
    if setting == OFF:
        return None
    base = default_node_lock_dir() if setting is None else Path(setting)
    key = hashlib.sha256(os.path.realpath(scope_dir).encode()).hexdigest()[:20]
    return base / key


def node_lock_path(root: Path, lock_path: Path) -> Path:
    """The node-local lock of the shard whose (shared) lock file is ``lock_path``."""
    return root / lock_path.parent.name / lock_path.name
