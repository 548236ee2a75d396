"""Directories of the cache: made safely when many processes and nodes race on them, and
the errors that say what is in the way."""

from __future__ import annotations

import errno
import os
import random
import stat
import time
from pathlib import Path

from .errors import CacheDirError
from .fsinfo import Mount, mount_for
from .redact import get_logger
from .trust import Trust

log = get_logger(__name__)

DIR_HINT = (
    "Set SHARDCACHE_DIR (or pass cache_dir=) to a writable node-local directory, "
    "e.g. local NVMe or /tmp/shardcache."
)
# "Not yet", on a shared file system: something another node just made may be invisible
# here for a while (NFS attribute/lookup caches: ENOENT), a handle may point at something
# replaced on the server (ESTALE), a dying server may return EIO. The one list of them.
NOT_YET_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE, errno.EIO, errno.EINTR})
# On a local file system "not yet" is a race (a directory removed while being made), over
# in milliseconds, or never over (a mkdir in /proc): retried this long (seconds), not for
# a network file system's cache time.
LOCAL_PATIENCE = 1.0
FULL_HINT = (
    "Free space there (shardcache evict, or remove other files), lower SHARDCACHE_MAX_BYTES, "
    "or set SHARDCACHE_DIR (or cache_dir=) to a node-local disk with room."
)
READ_ONLY_HINT = (
    "The file system is read-only (mounted so, or remounted read-only after errors: see "
    "dmesg): set SHARDCACHE_DIR (or cache_dir=) to a writable node-local directory."
)


def patience(path: Path, timeout: float) -> tuple[float, Mount]:
    """How long "not yet" errors making ``path`` are worth retrying (``timeout`` on a
    network file system, whose lookup caches lag, else at most ``LOCAL_PATIENCE``), and the
    mount it is on."""
    mount = mount_for(path)
    return (timeout if mount.is_network else min(timeout, LOCAL_PATIENCE)), mount


def _describe_parent(path: Path) -> str:
    parent = path.parent
    try:
        st = parent.stat()
    except OSError as exc:
        return f"parent {parent} cannot be examined: {exc.strerror or exc}"
    return (
        f"parent {parent} owned by uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}; "
        f"this process runs as uid {os.geteuid()}"
    )


def _file_in_the_way(path: Path) -> Path | None:
    """The deepest existing non-directory among ``path`` and its ancestors."""
    for candidate in (path, *path.parents):
        try:
            st = candidate.stat()
        except OSError:
            continue
        return None if stat.S_ISDIR(st.st_mode) else candidate
    return None


def kind_of(st: os.stat_result) -> str:
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a non-directory"


def not_a_dir(target: Path, blocker: Path) -> CacheDirError:
    try:
        what = kind_of(blocker.stat())
    except OSError:
        what = "a non-directory"
        if blocker.is_symlink():
            what = f"a dangling symbolic link (to {os.readlink(blocker)}, which does not exist)"
    seen = f"{what} exists at {blocker}"
    return CacheDirError(
        f"Cannot create cache directory {target}: expected a writable directory, but "
        f"{seen}. Remove or rename it. {DIR_HINT}",
        path=str(target),
        expected="a writable directory",
        seen=seen,
        hint=DIR_HINT,
        errno=errno.ENOTDIR if blocker != target else errno.EEXIST,
    )


def dir_error(target: Path, exc: OSError, action: str) -> CacheDirError:
    """Turn an OSError met while ``action`` (e.g. "creating") ``target`` into a CacheDirError."""
    where = Path(exc.filename) if exc.filename else target
    code = exc.errno
    hint = DIR_HINT
    if code in (errno.EACCES, errno.EPERM):
        seen = f"permission denied {action} {where} ({_describe_parent(where)})"
    elif code == errno.EROFS:
        seen, hint = f"read-only file system at {where}", READ_ONLY_HINT
    elif code in (errno.ENOSPC, errno.EDQUOT):
        seen, hint = f"no space or quota left at {where} ({exc.strerror})", FULL_HINT
    elif code == errno.ENOTDIR:
        blocker = _file_in_the_way(where) or where
        return not_a_dir(target, blocker)
    elif code == errno.ENAMETOOLONG:
        seen = f"path too long: {where}"
    elif code == errno.ELOOP:
        seen = f"too many levels of symbolic links at {where}"
    else:
        name = errno.errorcode.get(code or 0, "unknown error")
        seen = f"{name} ({exc.strerror or exc}) {action} {where}"
    return CacheDirError(
        f"Cannot use cache directory {target}: expected a writable directory, but saw "
        f"{seen}. {hint}",
        path=str(target),
        expected="a writable directory",
        seen=seen,
        hint=hint,
        errno=code,
    )


def _refresh_listing(path: Path) -> None:
    """List the nearest existing ancestor: on NFS this revalidates cached lookups."""
    for ancestor in path.parents:
        try:
            # A full listing: on NFS, reading the directory revalidates its cache.
            list(ancestor.iterdir())
        except OSError:
            continue
        return


def _ensure_once(target: Path, mode: int, trust: Trust | None) -> None:
    """One pass: mkdir each missing component top-down, then stat the target."""
    missing: list[Path] = []
    probe = target
    while True:
        try:
            st = probe.stat()
        except FileNotFoundError:
            missing.append(probe)
            if probe.parent == probe:
                raise
            probe = probe.parent
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise not_a_dir(target, probe)
        break
    for component in reversed(missing):
        try:
            component.mkdir(mode)
            if trust is not None:
                trust.adopt_dir(component)
        except FileExistsError:
            # Usually another process won the race. A non-directory shows up in the
            # final stat (or as ENOTDIR below); a dangling symlink would otherwise look
            # like a transient ENOENT and be retried until the deadline.
            if component.is_symlink() and not component.exists():
                raise not_a_dir(target, component) from None
    st = target.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise not_a_dir(target, target)


def ensure_dir(
    path: Path | str, mode: int = 0o755, timeout: float = 30.0, trust: Trust | None = None
) -> Path:
    """Create ``path`` and its parents, safely when many processes/nodes race on it.

    EEXIST is success; the result is verified with ``stat``. ENOENT/ESTALE/EIO (a
    component another node just made may not be visible yet) are retried with jittered
    exponential backoff until ``timeout`` on a network file system, for at most
    ``LOCAL_PATIENCE`` on a local one. Never grants world-write. With ``trust``, the
    directories it makes get the cache's mode and group instead of ``mode``. Returns the
    absolute path; raises ``CacheDirError`` saying what was in the way and what to do.
    """
    target = Path(path).absolute()
    mode &= ~0o002
    start = time.monotonic()
    deadline: float | None = None  # set by the first "not yet" error
    mount: Mount | None = None
    delay = 0.005
    attempts = 0
    while True:
        attempts += 1
        try:
            _ensure_once(target, mode if trust is None else trust.dir_mode, trust)
            return target
        except CacheDirError:
            raise
        except OSError as exc:
            now = time.monotonic()
            if exc.errno not in NOT_YET_ERRNOS:
                raise dir_error(target, exc, "creating") from exc
            if deadline is None:
                waited, mount = patience(target, timeout)
                deadline = start + waited
            if now >= deadline:
                error = dir_error(target, exc, "creating")
                why = (
                    "on NFS a directory made on another node can take up to the "
                    "attribute-cache time (actimeo, 60 s by default) to appear."
                    if mount is not None and mount.is_network
                    else f"the file system ({mount.describe() if mount else '?'}) is local: "
                    "it does not allow a directory there."
                )
                raise CacheDirError(
                    f"{error.message} Still failing after {attempts} attempts over "
                    f"{now - start:.1f}s; {why}",
                    **error.details,
                    attempts=attempts,
                    elapsed=now - start,
                ) from exc
            log.debug("ensure_dir %s: %s (attempt %d), retrying", target, exc, attempts)
            _refresh_listing(Path(exc.filename) if exc.filename else target)
            # Full jitter spreads out processes that failed together.
            time.sleep(min(delay * random.uniform(0.5, 1.5), max(deadline - now, 0.0)))
            delay = min(delay * 2, 1.0)
