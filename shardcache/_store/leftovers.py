"""Download temp files (``.part``) of dead processes of this host: judged and removed.

A writer that cannot unwind (SIGKILL, the OOM killer, a time limit's SIGTERM followed by
SIGKILL) leaves its ``.part``, which takes disk space and counts against
SHARDCACHE_MAX_BYTES until it is removed. It is removed:

* by the index's count of downloads in progress (:mod:`shardcache._store.index`), under the
  scope's eviction lock, each time room is made (a bounded cache's every miss);
* by a miss of a process that keeps no index, under its shard's lock: the ``.part`` files of
  the shard's directory (``data/<hh>/``, one listing of names);
* by ``shardcache clean``, which also removes those of other hosts after a day.

A ``.part`` is a dead writer's when its name says it was written on this host, its pid no
longer exists, now belongs to a process started after the file was last written (a reused
pid) or has exited (a zombie), and no process holds a ``flock`` on it (a writer holds a
shared one from creation to publication, so a live writer whose pid this process cannot
see, in another pid namespace, is never taken for dead). A pid of another host is never judged here.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .._base.errors import CacheDirError
from .._base.process_identity import exited, start_ticks, start_time
from .._base.redact import get_logger
from .._base.safefs import SafeFS
from .._disk.layout import CacheLayout, TempName, host_tag, parse_temp_name
from .pins import is_held

logger = get_logger("shardcache._cache")  # the cache's records keep one logger name

CLOCK_SLACK = 2.0  # seconds: process start times from /proc are coarse


def dead_writer(fs: SafeFS, path: Path, temp: TempName, st: os.stat_result) -> str | None:
    """Why the writer of the temp file ``path`` (named ``temp``, lstat ``st``) is dead, or
    None while it may be alive (or is on another host: its pid means nothing here)."""
    if temp.host != host_tag():
        return None
    ticks = start_ticks(temp.pid)
    if ticks is None:
        reason = f"pid {temp.pid} no longer exists"
    elif exited(temp.pid):
        reason = f"pid {temp.pid} has exited (not reaped yet)"
    else:
        started = start_time(ticks)
        if started is None or started <= st.st_mtime + CLOCK_SLACK:
            return None
        reason = f"pid {temp.pid} now belongs to a process started after the file was written"
    if is_held(fs, path):  # a live writer this process cannot see (another pid namespace)
        return None
    return reason


def remove_if_dead(layout: CacheLayout, path: Path, st: os.stat_result) -> bool:
    """Remove the temp file ``path`` (lstat ``st``) if its writer is dead; whether it did."""
    temp = parse_temp_name(path.name)
    if temp is None:
        return False
    reason = dead_writer(layout.fs, path, temp, st)
    if reason is None:
        return False
    try:
        layout.fs.unlink(path)
    except FileNotFoundError:
        return True  # removed meanwhile (another process sweeping, `shardcache clean`)
    except OSError as exc:
        logger.warning("cannot remove %s, left by a dead download (%s): %s", path, reason, exc)
        return False
    logger.info("removed %s (%d bytes), left by a dead download: %s", path, st.st_size, reason)
    return True


def remove_dead_parts(layout: CacheLayout, directory: Path) -> int:
    """Remove the temp files of dead writers in the data directory ``directory``; the
    bytes removed. One listing of names; only temp files of this host are looked at."""
    try:
        with layout.fs.directory(directory) as dir_fd:
            names = [n for n in os.listdir(dir_fd) if n.endswith(".part")]
    except (FileNotFoundError, NotADirectoryError):
        return 0
    except (OSError, CacheDirError) as exc:
        logger.debug("cannot list %s for leftover downloads: %s", directory, exc)
        return 0
    mine = f".{host_tag()}."
    removed = 0
    for name in names:
        if mine not in name:
            continue
        path = directory / name
        try:
            st = layout.fs.lstat(path)
        except (OSError, CacheDirError):
            continue
        if stat.S_ISREG(st.st_mode) and remove_if_dead(layout, path, st):
            removed += st.st_size
    return removed


__all__ = ["CLOCK_SLACK", "dead_writer", "remove_dead_parts", "remove_if_dead"]
