"""Ranks, race-free directories, and waits that explain themselves when they time out.

The failures this module exists for: ranks that wait for a directory rank 0 creates and
time out on NFS/Lustre (the creating node sees it at once; the others' lookup caches say
"no such file" for up to ``actimeo``, 60 s by default), and ``FileExistsError`` from
concurrent ``os.makedirs``. The robust pattern is for *every* rank to call
:func:`makedirs` (it is race-free); :func:`makedirs_once` exists for jobs that want one
creator per node, and :func:`wait_for` for anything else one rank makes and others await.

torch is never imported here: a process group can only exist if the program already
imported ``torch.distributed``, so that module is looked up in ``sys.modules``.
"""

from __future__ import annotations

import os
import random
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ._base.dirs import NOT_YET_ERRNOS, ensure_dir
from ._base.errors import WaitTimeout
from ._base.fsinfo import mount_for
from ._base.redact import get_logger
from ._config.launcher import local_world_size
from ._config.settings import Settings

log = get_logger(__name__)

# How often a long wait logs "still waiting" at INFO (seconds).
PROGRESS_EVERY = 30.0
# Entries of the parent directory shown in a WaitTimeout message.
LISTING_LIMIT = 20

NFS_HINT = (
    "NFS caches directory lookups for up to 60 s (actimeo / lookupcache): create the "
    "directory on every rank with shardcache.distributed.makedirs instead of waiting for "
    "rank 0, or raise the timeout."
)


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the job.

    ``source`` says where ``rank``/``world_size`` came from: ``"torch.distributed"`` (an
    initialised process group), ``"torchrun"`` or ``"slurm"`` (launcher variables),
    ``"env"`` (``SHARDCACHE_RANK`` / ``SHARDCACHE_WORLD_SIZE``) or ``"default"``.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None
    node_rank: int
    job_id: str | None
    source: str

    def describe(self) -> str:
        local = "?" if self.local_world_size is None else str(self.local_world_size)
        job = f", job {self.job_id}" if self.job_id else ""
        return (
            f"rank {self.rank}/{self.world_size} (local rank {self.local_rank}/{local}, "
            f"node {self.node_rank}{job}; from {self.source})"
        )


def _initialised_dist() -> ModuleType | None:
    """``torch.distributed`` if it is imported, available and has a default process group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return dist
    except (AttributeError, RuntimeError):  # a partially imported or broken torch
        return None
    return None


def _source(sources: Mapping[str, str]) -> str:
    label = sources.get("rank", "default")
    if label == "default":
        label = sources.get("world_size", "default")
    if "(torchrun)" in label:
        return "torchrun"
    if "(slurm)" in label:
        return "slurm"
    return "default" if label == "default" else "env"


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """This process's rank, local rank, world size, node and job.

    ``rank``/``world_size`` come from ``torch.distributed`` when a process group is
    initialised, else (like everything else) from :meth:`Settings.resolve`: ``SHARDCACHE_*``
    > torchrun > SLURM > defaults. ``local_world_size`` is ``LOCAL_WORLD_SIZE``,
    ``SLURM_NTASKS_PER_NODE`` or this node's entry of ``SLURM_TASKS_PER_NODE``, else None.
    Raises ``ConfigError`` for inconsistent or malformed launcher variables.
    """
    settings = Settings.resolve(env)
    rank, world_size, source = settings.rank, settings.world_size, _source(settings.sources)
    dist = _initialised_dist()
    if dist is not None:
        rank, world_size, source = dist.get_rank(), dist.get_world_size(), "torch.distributed"
    return RankInfo(
        rank=rank,
        local_rank=settings.local_rank,
        world_size=world_size,
        local_world_size=local_world_size(settings.node_rank, env),
        node_rank=settings.node_rank,
        job_id=settings.job_id,
        source=source,
    )


def barrier() -> bool:
    """``torch.distributed.barrier()`` if a process group is initialised; True if it ran.

    A collective: every rank of the default group must call it.
    """
    dist = _initialised_dist()
    if dist is None:
        return False
    dist.barrier()
    return True


def gather_objects(value: object) -> list[Any] | None:
    """Every rank's ``value`` (picklable), in rank order, through the default process group
    (``all_gather_object``; bounded by the group's timeout); None if none is initialised.

    A collective: every rank of the default group must call it. Not in a DataLoader
    worker: a forked worker inherits the group's Python state, not a working group.
    """
    dist = _initialised_dist()
    if dist is None:
        return None
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def makedirs(path: Path | str, mode: int = 0o755, timeout: float = 30.0) -> Path:
    """Create ``path`` and its parents; safe when any number of processes/nodes race.

    Existing directories are success; ENOENT/ESTALE/EIO from a shared file system's
    caches are retried until ``timeout``. Returns the absolute path; raises
    ``CacheDirError`` when something is in the way. See :func:`shardcache._base.dirs.ensure_dir`.
    """
    return ensure_dir(path, mode=mode, timeout=timeout)


def _refresh(path: Path) -> None:
    """List the nearest existing ancestor of ``path``: on NFS that revalidates lookups."""
    for ancestor in path.parents:
        try:
            os.listdir(ancestor)
        except OSError:
            continue
        return


def wait_for(
    predicate: Callable[[], bool],
    what: str,
    timeout: float,
    path: Path | str | None = None,
    *,
    poll: float = 0.05,
    max_poll: float = 2.0,
    progress_every: float = PROGRESS_EVERY,
) -> None:
    """Poll ``predicate`` until it returns true, or raise :class:`WaitTimeout`.

    Polls with jittered exponential backoff from ``poll`` to ``max_poll`` seconds. Before
    each check the parent of ``path`` (if given) is listed, which refreshes NFS lookup
    caches. An ``OSError`` ENOENT/ESTALE/EIO from the predicate means "not yet" (the last
    one is reported); other exceptions propagate. The predicate is checked once more at
    the deadline. Logs progress at INFO every ``progress_every`` seconds (30 by default).
    """
    target = None if path is None else Path(path).absolute()
    start = time.monotonic()
    deadline = start + timeout
    next_log = start + progress_every
    delay = poll
    checks = 0
    last_error: OSError | None = None
    while True:
        if target is not None:
            _refresh(target)
        checks += 1
        try:
            if predicate():
                if checks > 1:
                    log.debug("%s: ready after %.2fs", what, time.monotonic() - start)
                return
        except OSError as exc:
            if exc.errno not in NOT_YET_ERRNOS:
                raise
            last_error = exc
        now = time.monotonic()
        if now >= deadline:
            raise _wait_timeout(
                what,
                target,
                elapsed=now - start,
                timeout=timeout,
                checks=checks,
                last_error=last_error,
            )
        if now >= next_log:
            log.info(
                "still waiting for %s%s after %.0fs of %.0fs (last error: %s)",
                what,
                f" at {target}" if target is not None else "",
                now - start,
                timeout,
                last_error or "none",
            )
            next_log = now + progress_every
        # Full jitter keeps ranks that started together from polling in lockstep.
        time.sleep(min(delay * random.uniform(0.5, 1.5), deadline - now))
        delay = min(delay * 2, max_poll)


def _exists_now(path: Path) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no"
    except OSError as exc:
        return f"cannot tell ({exc})"
    return "yes, a directory" if stat.S_ISDIR(st.st_mode) else "yes, but not a directory"


def _listing(directory: Path) -> tuple[list[str], int | None, str]:
    """(first entries, count or None, one-line description) of ``directory``."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        return [], None, f"parent {directory}: cannot list ({exc})"
    shown = names[:LISTING_LIMIT]
    more = f", ... ({len(names) - len(shown)} more)" if len(names) > len(shown) else ""
    body = ", ".join(shown) + more if names else "(empty)"
    return shown, len(names), f"parent {directory} ({len(names)} entries): {body}"


def _wait_timeout(
    what: str,
    path: Path | None,
    *,
    elapsed: float,
    timeout: float,
    checks: int,
    last_error: OSError | None,
) -> WaitTimeout:
    host = socket.gethostname()
    pid = os.getpid()
    try:
        info: RankInfo | None = rank_info()
        who = info.describe()
    except Exception as exc:  # diagnostics must not hide the timeout
        info = None
        who = f"rank unknown ({type(exc).__name__}: {exc})"
    lines = [
        f"timed out after {elapsed:.1f}s (timeout {timeout:g}s, {checks} checks) waiting for "
        f"{what}" + (f" at {path}" if path is not None else "") + "."
    ]
    lines.append(f"  waiter: host {host} pid {pid} {who}")
    details: dict[str, object] = {}
    fstype = options = None
    if path is not None:
        exists = _exists_now(path)
        mount = mount_for(path)
        fstype, options = mount.fstype, mount.options
        entries, count, listing = _listing(path.parent)
        lines += [
            f"  path: {path} (exists now: {exists})",
            f"  file system: {mount.describe()}",
            f"  {listing}",
        ]
        details |= {"exists": exists, "parent_entries": entries, "parent_count": count}
        if mount.is_network:
            hint = f"{path} is on {fstype}, a network file system. {NFS_HINT}"
        else:
            hint = (
                f"check that the process that should create it is running and got that far "
                f"({fstype} here; a node-local path is not visible to other nodes). {NFS_HINT}"
            )
    else:
        hint = (
            "check that the process expected to make this true is running and got that far, "
            "or raise the timeout."
        )
    error = f"{type(last_error).__name__}: {last_error}" if last_error is not None else None
    lines.append(f"  last error: {error or 'none'}")
    lines.append(f"  what to do: {hint}")
    return WaitTimeout(
        "\n".join(lines),
        what=what,
        path=None if path is None else str(path),
        elapsed=elapsed,
        timeout=timeout,
        checks=checks,
        host=host,
        pid=pid,
        rank=None if info is None else info.rank,
        fstype=fstype,
        mount_options=options,
        last_error=error,
        hint=hint,
        **details,
    )


def _is_dir(path: Path) -> bool:
    # os.stat, not Path.is_dir: ESTALE/EIO must reach wait_for to be reported.
    return stat.S_ISDIR(os.stat(path).st_mode)


def makedirs_once(
    paths: Iterable[Path | str] | Path | str, timeout: float = 300.0, mode: int = 0o755
) -> list[Path]:
    """Local rank 0 creates ``paths``; the other ranks wait for them. Returns absolute paths.

    With an initialised ``torch.distributed`` process group the wait is a *global*
    ``barrier()`` (a node-level one would need subgroups), so every rank of the default
    group must call this, and the barrier's time limit is the group's, not ``timeout``.
    Without a group, ranks with a non-zero local rank poll with :func:`wait_for`
    (``WaitTimeout`` after ``timeout``). Afterwards those ranks also call :func:`makedirs`
    themselves: cheap when the directories exist, and correct when a shared file system's
    caches still hide them.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    targets = [Path(p).absolute() for p in paths]
    info = rank_info()
    grouped = _initialised_dist() is not None
    if info.local_rank == 0:
        failure: BaseException | None = None
        try:
            for target in targets:
                makedirs(target, mode=mode, timeout=timeout)
        except Exception as exc:
            # Still enter the barrier, so the other ranks fail on their own makedirs
            # instead of hanging until the process group times out.
            failure = exc
        if grouped:
            barrier()
        if failure is not None:
            raise failure
        return targets
    if grouped:
        barrier()
    else:
        deadline = time.monotonic() + timeout
        for target in targets:
            wait_for(
                lambda target=target: _is_dir(target),
                f"directory {target} (made by local rank 0)",
                max(deadline - time.monotonic(), 0.0),
                path=target,
            )
    for target in targets:
        makedirs(target, mode=mode, timeout=timeout)
    return targets


__all__ = [
    "RankInfo",
    "WaitTimeout",
    "barrier",
    "makedirs",
    "makedirs_once",
    "rank_info",
    "wait_for",
]
