"""Where things live in the cache, and race-free directory creation.

::

    <scope>/data/<hh>/<readable>-<digest20><suffix>        published shards
    <scope>/data/<hh>/.<final>.<host>.<pid>.<token>.part   downloads in progress
    <scope>/.locks/<hh>/<digest64>.lock                    lock files (never deleted)

``<digest>`` is the sha256 of the endpoint namespace and the full URL, so distinct URLs
(or the same key on two endpoints) never share a path; ``<readable>`` is only a
sanitised hint for humans, and no URL can make a path leave ``<scope>``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import secrets
import socket
import stat
import time
from pathlib import Path
from typing import NamedTuple

from .errors import CacheDirError, ConfigError
from .redact import get_logger

log = get_logger(__name__)

DIR_HINT = (
    "Set SHARDCACHE_DIR (or pass cache_dir=) to a writable node-local directory, "
    "e.g. local NVMe or /tmp/shardcache."
)

_UNSAFE_RE = re.compile(r"[^A-Za-z0-9._-]")
_EXT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
# An extension that may precede the last one (".tar" in ".tar.gz"); must start with a
# letter so shard numbers ("train.000123.tar") stay in the readable stem.
_INNER_EXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9]{0,5}")
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TEMP_RE = re.compile(
    r"^\.(?P<final>.+)\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>[0-9]{1,10})"
    r"\.(?P<token>[A-Za-z0-9_-]{1,64})\.part$"
)
_MAX_STEM = 64
_MAX_SUFFIX = 12
_MAX_HOST = 64
_DIGEST_CHARS = 20
# A component that another node just created may be invisible here for a while (NFS
# attribute/lookup caches); a dying server may return EIO. These mean "not yet".
_RETRY_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE, errno.EIO, errno.EINTR})


def cache_key(url: str, namespace: str = "") -> str:
    """Hex sha256 of ``namespace + "\\n" + url`` (namespace: the endpoint, e.g. "s3@host")."""
    if "\n" in namespace:
        # A newline would make (namespace, url) pairs ambiguous, and keys collide.
        raise ConfigError(
            f"Cache namespace {namespace!r} contains a newline; expected a single-line "
            "endpoint identifier such as 's3@http://127.0.0.1:9000'.",
            namespace=namespace,
        )
    data = f"{namespace}\n{url}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def sanitize_name(name: str) -> str:
    """Map ``name`` to ``[A-Za-z0-9._-]`` (others -> ``_``) with no leading dot or dash."""
    return _UNSAFE_RE.sub("_", name).lstrip(".-")


def host_tag() -> str:
    """This host's name as it appears in temp-file names (no dots, filename-safe)."""
    host = _UNSAFE_RE.sub("_", socket.gethostname()).replace(".", "_")[:_MAX_HOST]
    return host or "unknown-host"


def _readable_name(url: str) -> str:
    """The URL's last path component: query/fragment removed, not percent-decoded."""
    rest = url
    scheme_end = rest.find("://")
    if scheme_end >= 0:
        rest = rest[scheme_end + 3 :]
        # Only real URLs have query strings; '?' and '#' are ordinary in local names.
        rest = rest.split("?", 1)[0].split("#", 1)[0]
    rest = rest.rstrip("/")
    return rest.rsplit("/", 1)[-1]


def _split_suffix(name: str) -> tuple[str, str]:
    """(stem, suffix): suffix is the last one or two short, sane extensions, or ""."""
    parts = name.split(".")
    if len(parts) < 2 or not parts[0]:
        return name, ""
    last = parts[-1]
    if not _EXT_RE.fullmatch(last) or len(last) + 1 > _MAX_SUFFIX:
        return name, ""
    if len(parts) >= 3 and parts[-3] and _INNER_EXT_RE.fullmatch(parts[-2]):
        double = f".{parts[-2]}.{last}"
        if len(double) <= _MAX_SUFFIX:
            return ".".join(parts[:-2]), double
    return ".".join(parts[:-1]), f".{last}"


class TempName(NamedTuple):
    """The parts of a temp-file name: ``.<final>.<host>.<pid>.<token>.part``."""

    final: str
    host: str
    pid: int
    token: str


def parse_temp_name(name: str) -> TempName | None:
    """Split a temp-file name into its parts; None when ``name`` is not one."""
    match = _TEMP_RE.match(name)
    if match is None:
        return None
    return TempName(match["final"], match["host"], int(match["pid"]), match["token"])


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a download-in-progress file made by ``temp_path``."""
    return parse_temp_name(name) is not None


class CacheLayout:
    """Paths of one cache scope directory (``<root>/rank-<R>`` or ``<root>/node``)."""

    def __init__(self, scope_dir: Path | str) -> None:
        self.scope_dir = Path(scope_dir)

    def __repr__(self) -> str:
        return f"CacheLayout({str(self.scope_dir)!r})"

    @property
    def data_dir(self) -> Path:
        """Where published shards live (``<scope>/data``)."""
        return self.scope_dir / "data"

    @property
    def locks_dir(self) -> Path:
        """Where lock files live (``<scope>/.locks``); eviction never touches it."""
        return self.scope_dir / ".locks"

    @property
    def meta_dir(self) -> Path:
        """Where each shard's metadata record lives (``<scope>/.meta``)."""
        return self.scope_dir / ".meta"

    def meta_path(self, final: Path) -> Path:
        """The metadata record of the published file ``final``: ``.meta/<hh>/<name>.json``."""
        return self.meta_dir / final.parent.name / f"{final.name}.json"

    def data_path_of_meta(self, meta: Path) -> Path:
        """The published file a metadata record describes (inverse of :meth:`meta_path`)."""
        return self.data_dir / meta.parent.name / meta.name.removesuffix(".json")

    def data_path(self, url: str, namespace: str = "") -> Path:
        """The published file for ``url``: ``data/<hh>/<readable>-<digest20><suffix>``."""
        key = cache_key(url, namespace)
        stem, suffix = _split_suffix(sanitize_name(_readable_name(url)))
        stem = stem[:_MAX_STEM] or "shard"
        # Invariant: the name has no '/', is never '.' or '..' (it holds the digest) and
        # stays below 255 bytes even inside a temp name: 64 + 1 + 20 + 12 = 97.
        name = f"{stem}-{key[:_DIGEST_CHARS]}{suffix}"
        return self.data_dir / key[:2] / name

    def lock_path(self, url: str, namespace: str = "") -> Path:
        """The lock file for ``url``: ``.locks/<hh>/<digest64>.lock``."""
        key = cache_key(url, namespace)
        return self.locks_dir / key[:2] / f"{key}.lock"

    def check_inside(self, directory: Path) -> None:
        """Raise CacheDirError unless every component of ``directory`` below the scope
        directory is a real directory, not a symbolic link: a link planted there (say
        ``data/<hh>`` -> ``/elsewhere``) would make downloads, renames and metadata writes
        land outside the cache root. The scope directory itself may be reached through links.
        """
        try:
            below = Path(directory).relative_to(self.scope_dir)
        except ValueError:
            return
        current = self.scope_dir
        for part in below.parts:
            current = current / part
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                return  # not made yet: mkdir will make a real directory
            except OSError as exc:
                raise dir_error(current, exc, "examining") from exc
            if not stat.S_ISDIR(st.st_mode):
                seen = f"{_kind(st)} at {current}"
                raise CacheDirError(
                    f"Refusing to use {current} inside the cache {self.scope_dir}: expected a "
                    f"directory, but saw {seen} (a link there could redirect writes outside the "
                    "cache). Remove it, or run 'shardcache clean'. " + DIR_HINT,
                    path=str(current),
                    expected="a directory",
                    seen=seen,
                    hint=DIR_HINT,
                )

    @staticmethod
    def temp_path(final: Path, token: str | None = None) -> Path:
        """A unique download file beside ``final``: ``.<name>.<host>.<pid>.<token>.part``."""
        if token is None:
            token = secrets.token_hex(8)
        elif not _TOKEN_RE.fullmatch(token):
            raise ValueError(f"temp token must match [A-Za-z0-9_-]{{1,64}}, got {token!r}")
        return final.parent / f".{final.name}.{host_tag()}.{os.getpid()}.{token}.part"


def scope_dir(root: Path | str, scope: str, rank: int) -> Path:
    """The scope directory: ``root/rank-<rank>`` for "rank", ``root/node`` for "node"."""
    root = Path(root)
    if scope == "node":
        return root / "node"
    if scope == "rank":
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(
                f"Invalid rank {rank!r} for scope 'rank'; expected an integer >= 0 "
                "(from RANK, SLURM_PROCID or rank=).",
                variable="rank",
                value=rank,
            )
        return root / f"rank-{rank}"
    raise ConfigError(
        f"Invalid cache scope {scope!r} (SHARDCACHE_SCOPE / scope=); expected 'node' "
        "(one cache shared by the processes of a node) or 'rank' (one per rank).",
        variable="SHARDCACHE_SCOPE",
        value=scope,
        accepted=("node", "rank"),
    )


# ------------------------------------------------------------------------ directories


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


def _kind(st: os.stat_result) -> str:
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


def _not_a_dir(target: Path, blocker: Path) -> CacheDirError:
    try:
        what = _kind(blocker.stat())
    except OSError:
        what = "a dangling symbolic link" if blocker.is_symlink() else "a non-directory"
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
    if code in (errno.EACCES, errno.EPERM):
        seen = f"permission denied {action} {where} ({_describe_parent(where)})"
    elif code == errno.EROFS:
        seen = f"read-only file system at {where}"
    elif code in (errno.ENOSPC, errno.EDQUOT):
        seen = f"no space or quota left at {where} ({exc.strerror})"
    elif code == errno.ENOTDIR:
        blocker = _file_in_the_way(where) or where
        return _not_a_dir(target, blocker)
    elif code == errno.ENAMETOOLONG:
        seen = f"path too long: {where}"
    elif code == errno.ELOOP:
        seen = f"too many levels of symbolic links at {where}"
    else:
        name = errno.errorcode.get(code or 0, "unknown error")
        seen = f"{name} ({exc.strerror or exc}) {action} {where}"
    return CacheDirError(
        f"Cannot use cache directory {target}: expected a writable directory, but saw "
        f"{seen}. {DIR_HINT}",
        path=str(target),
        expected="a writable directory",
        seen=seen,
        hint=DIR_HINT,
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


def _ensure_once(target: Path, mode: int) -> None:
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
            raise _not_a_dir(target, probe)
        break
    for component in reversed(missing):
        try:
            component.mkdir(mode)
        except FileExistsError:
            # Usually another process won the race. A non-directory shows up in the
            # final stat (or as ENOTDIR below); a dangling symlink would otherwise look
            # like a transient ENOENT and be retried until the deadline.
            if component.is_symlink() and not component.exists():
                raise _not_a_dir(target, component) from None
    st = target.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise _not_a_dir(target, target)


def ensure_dir(path: Path | str, mode: int = 0o755, timeout: float = 30.0) -> Path:
    """Create ``path`` and its parents, safely when many processes/nodes race on it.

    EEXIST is success; the result is verified with ``stat``. ENOENT/ESTALE/EIO (a
    component another node just made may not be visible yet) are retried with jittered
    exponential backoff until ``timeout``. Never grants world-write. Returns the
    absolute path; raises ``CacheDirError`` saying what was in the way and what to do.
    """
    target = Path(path).absolute()
    mode &= ~0o002
    start = time.monotonic()
    deadline = start + timeout
    delay = 0.005
    attempts = 0
    while True:
        attempts += 1
        try:
            _ensure_once(target, mode)
            return target
        except CacheDirError:
            raise
        except OSError as exc:
            now = time.monotonic()
            if exc.errno not in _RETRY_ERRNOS:
                raise dir_error(target, exc, "creating") from exc
            if now >= deadline:
                error = dir_error(target, exc, "creating")
                raise CacheDirError(
                    f"{error.message} Still failing after {attempts} attempts over "
                    f"{now - start:.1f}s; on NFS a directory made on another node can take "
                    "up to the attribute-cache time (actimeo, 60 s by default) to appear.",
                    **error.details,
                    attempts=attempts,
                    elapsed=now - start,
                ) from exc
            log.debug("ensure_dir %s: %s (attempt %d), retrying", target, exc, attempts)
            _refresh_listing(Path(exc.filename) if exc.filename else target)
            # Full jitter spreads out processes that failed together.
            time.sleep(min(delay * random.uniform(0.5, 1.5), max(deadline - now, 0.0)))
            delay = min(delay * 2, 1.0)


def check_writable(path: Path | str) -> None:
    """Create and remove a uniquely named probe file in ``path``; CacheDirError if that fails."""
    directory = Path(path)
    probe = directory / f".shardcache-probe-{host_tag()}-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise dir_error(directory, exc, "creating a file in") from exc
    try:
        # Write a byte: ENOSPC/EDQUOT may only show on write, not on create.
        os.write(fd, b"\0")
    except OSError as exc:
        raise dir_error(directory, exc, "writing a file in") from exc
    finally:
        os.close(fd)
        try:
            probe.unlink()
        except OSError as exc:
            log.warning("could not remove write probe %s: %s", probe, exc)


__all__ = [
    "CacheLayout",
    "TempName",
    "cache_key",
    "check_writable",
    "dir_error",
    "ensure_dir",
    "host_tag",
    "is_temp_name",
    "parse_temp_name",
    "sanitize_name",
    "scope_dir",
]
