"""The spool through which DataLoader workers hand their epoch totals to their main process.

One small JSON file per worker and epoch in ``<tmp>/shardcache-<euid>/metrics-spool/<main
pid>/`` (the pid of the process that started the worker, whatever the start method),
written under a temporary name and renamed, so the main process reads only complete files.
The temporary directory is shared with other users: every operation goes through
:class:`SafeFS` with private trust, so a directory or link planted there by someone else is
refused (the totals are then lost, with a warning) instead of redirecting a write or
feeding the report someone else's counts.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from .._base.process_identity import start_ticks, start_time
from .._base.redact import get_logger
from .._base.safefs import SafeFS
from .._base.trust import Trust

logger = get_logger(__name__)

CLOCK_SLACK = 2.0  # seconds: a process's start time from /proc is coarse
MAX_TOTAL_BYTES = 1 << 20  # far above an epoch total (a few kB): a larger file is not ours


def spool_root() -> Path:
    """``<tmp>/shardcache-<euid>/metrics-spool``: every process of a user on a node finds it."""
    return Path(tempfile.gettempdir()) / f"shardcache-{os.geteuid()}" / "metrics-spool"


def _main_pid() -> int:
    """The pid of the process that started this DataLoader worker (the rank's main process).
    Not always the OS parent: a worker of ``multiprocessing_context="forkserver"`` is the
    forkserver's child; multiprocessing records the process that asked for it."""
    parent = multiprocessing.parent_process()
    return os.getppid() if parent is None or parent.pid is None else parent.pid


def spool(total: dict[str, Any]) -> None:
    """Hand this worker's epoch ``total`` to its parent (the rank's main process)."""
    fs = SafeFS(spool_root(), Trust.private())
    directory = fs.root / str(_main_pid())
    name = f"{os.getpid()}-e{total['epoch']}-{time.monotonic_ns()}.json"
    tmp = directory / f".{name}.tmp"
    try:
        fs.mkdirs(directory)
        fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(total))
        fs.replace(tmp, directory / name)
    except OSError as exc:  # CacheDirError too: a foreign directory or a link on the way
        logger.warning("cannot hand this worker's metrics to its main process: %s", exc)


def _started() -> float | None:
    """When this process started (less a margin for /proc's coarse clock), if known."""
    ticks = start_ticks(os.getpid())
    started = None if ticks is None else start_time(ticks)
    return None if started is None else started - CLOCK_SLACK


def unspool(after: float | None = None) -> list[dict[str, Any]]:
    """The epoch totals this process's DataLoader workers spooled since the last call (and
    since ``after``, a time, if given; older ones are dropped)."""
    fs = SafeFS(spool_root(), Trust.private())
    directory = fs.root / str(os.getpid())
    try:
        with fs.directory(directory) as fd:
            names = sorted(n for n in os.listdir(fd) if n.endswith(".json"))
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("cannot read the metrics this process's workers spooled: %s", exc)
        return []
    found: list[dict[str, Any]] = []
    since = _started()
    if after is not None:
        since = after if since is None else max(since, after)
    for name in names:
        path = directory / name
        with contextlib.suppress(OSError, ValueError):
            if since is None or fs.lstat(path).st_mtime >= since:
                found.append(json.loads(fs.read_small(path, MAX_TOTAL_BYTES)))
            else:  # left by workers of an earlier process that had this pid (or an earlier
                # state of this one's metrics)
                logger.debug("ignoring %s: spooled before this process's metrics began", path)
        with contextlib.suppress(OSError):
            fs.unlink(path)
    with contextlib.suppress(OSError), fs.directory(fs.root) as root_fd:
        os.rmdir(directory.name, dir_fd=root_fd)  # made again by the next worker that spools
    return found
