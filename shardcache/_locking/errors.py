"""The errors a shard lock raises, each built to say what, where, expected and what to do.

:func:`lock_file_error`: a lock file that cannot be created or locked (path, errno, the
file system, the cause and its remedy), never a timeout blaming an unknown holder.
:func:`lock_timeout`: a wait given up (the lock file and its mode, the waiter, the holder and
its verdict, how long and how often it waited, and the hint that fits the verdict). Both are
here, beside the errors themselves, so that the eviction lock builds the first without
importing the shard lock.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

from .._base.dirs import NOT_YET_ERRNOS
from .._base.errors import LockFileError, LockTimeout
from .._base.fsinfo import mount_for
from .._base.process_identity import ProcessIdentity
from .records import describe_holder

# Errors that may clear by themselves while creating a lock file: the "not yet" errors of
# a shared file system, and a claim name that is still being removed (EEXIST).
CREATE_TRANSIENT_ERRNOS = NOT_YET_ERRNOS | {errno.EEXIST}

_UNSUPPORTED_ERRNOS = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP})


def lock_timeout(
    *,
    path: Path,
    url: str,
    mode: str,
    rank: int,
    fronts: Path | None,
    record_path: Path,
    owner: dict[str, Any] | None,
    verdict: str,
    why: str,
    elapsed: float,
    attempts: int,
    cause: str,
) -> LockTimeout:
    """The error for a wait given up on the lock file ``path`` (``mode``) by this thread
    (``rank``): the holder's ``owner`` record (read at ``record_path``) and its verdict,
    ``cause``; ``fronts``: the lease a node-local lock stands in front of."""
    mount = mount_for(path)
    me = ProcessIdentity.current()
    if verdict == "alive" and owner:
        hint = (
            f"inspect the holder (py-spy dump --pid {owner.get('pid')}) or kill it: the "
            "kernel frees its lock when it exits. If its downloads are legitimately "
            "slow, raise SHARDCACHE_LOCK_STUCK_AFTER / SHARDCACHE_LOCK_TIMEOUT."
        )
    elif mode == "flock" and mount.is_network:
        hint = (
            "the cache is on a network file system where flock can mislead; set "
            "SHARDCACHE_LOCK_MODE=lease or move SHARDCACHE_DIR to a node-local disk."
        )
    else:
        hint = (
            "check that the holder is still running and can reach the remote store; "
            "raise SHARDCACHE_LOCK_TIMEOUT if downloads are slow."
        )
    return LockTimeout(
        f"timed out waiting for the lock of {url}: {cause}.\n"
        f"  lock file: {path} ({mode} mode) on {mount.describe()}\n"
        f"{_fronts_line(fronts)}"
        f"  waiter: host {me.host} pid {me.pid} rank {rank} thread "
        f"{threading.current_thread().name}\n"
        f"  holder: {_describe_owner(owner, record_path)}\n"
        f"  verdict: {verdict} ({why})\n"
        f"  waited {elapsed:.1f}s over {attempts} attempts\n"
        f"  what to do: {hint}",
        url=url,
        path=str(path),
        owner=owner,
        verdict=verdict,
        elapsed=elapsed,
        attempts=attempts,
    )


def _fronts_line(fronts: Path | None) -> str:
    if fronts is None:
        return ""
    return (
        f"  (the node-local lock in front of the lease {fronts}: its holder is the "
        "process of this node that contends for the lease)\n"
    )


def _describe_owner(owner: dict[str, Any] | None, record_path: Path) -> str:
    if owner is not None:
        return describe_holder(owner)
    return (
        f"unknown: no readable owner record at {record_path} (the holder "
        "may be unable to write it: a full disk, a read-only or unwritable directory; or "
        "it has just started)"
    )


def lock_file_error(path: Path, url: str | None, exc: OSError, attempts: int) -> LockFileError:
    """The error for a lock file that cannot be created or locked: path, errno, what to do."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, str(code))
    where = exc.filename or path
    if code in _UNSUPPORTED_ERRNOS:
        what = (
            f"flock is not supported on {mount_for(path).describe()}; set "
            "SHARDCACHE_LOCK_MODE=lease for this file system"
        )
    elif code == errno.ELOOP:
        what = (
            "a symbolic link stands where the lock file belongs (lock files are never "
            "followed out of the cache): remove it"
        )
    elif code in (errno.ENOSPC, errno.EDQUOT):
        what = "the disk or quota is full: free space on it or move SHARDCACHE_DIR"
    elif code == errno.EROFS:
        what = (
            "the file system is read-only (mounted so, or remounted read-only after errors): "
            "check it (dmesg) or point SHARDCACHE_DIR at a writable disk"
        )
    elif code in CREATE_TRANSIENT_ERRNOS:
        what = (
            f"the error persisted over {attempts} attempts; something keeps removing the "
            "cache's directories, or the (network) file system is failing: check it and "
            "the tmp cleaners of this node"
        )
    else:
        what = "check that the cache directory is writable (SHARDCACHE_DIR)"
    for_url = f" for {url}" if url else ""
    return LockFileError(
        f"cannot create or lock the lock file {path}{for_url}: {name} "
        f"({exc.strerror or exc}) at {where}; expected a writable lock directory. "
        f"What to do: {what}.",
        path=str(path),
        url=url,
        errno=code,
        attempts=attempts,
        cause=f"{name}: {exc.strerror or exc}",
    )


__all__ = ["CREATE_TRANSIENT_ERRNOS", "lock_file_error", "lock_timeout"]
