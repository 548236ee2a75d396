"""Cache entries and least-recently-used eviction.

The evictor removes a file only while holding an exclusive ``flock`` on it, taken without
blocking, so it never removes a shard a reader has pinned (:mod:`shardcache._store.pins`). A
reader that opens a file the evictor is removing gets a complete copy anyway (an open file
outlives its name).

Evictions of one scope directory are serialised by ``.locks/evict.lock`` so two processes
never both count the same free space. "Last used" is the file's mtime, refreshed on hits
(at most once a minute per shard).

:func:`evict_locked` here finds candidates by listing the data directory: linear in the
cache. A size-bounded cache on a local disk evicts from the scope's index instead
(:mod:`shardcache._store.index`, same rules, constant cost); the listing remains for network
file systems and for the disk-full pass of caches without ``max_bytes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._base.dirs import dir_error
from .._base.errors import CacheDirError, LockTimeout
from .._base.redact import get_logger
from .._base.safefs import SafeFS
from .._disk.layout import CacheLayout, is_temp_name
from .._disk.metadata import read_meta, read_meta_at
from .._locking.errors import lock_file_error
from .._locking.flock import try_flock

logger = get_logger(__name__)

TOUCH_INTERVAL = 60.0  # refresh a hit's "last used" time at most this often
EVICT_LOCK_TIMEOUT = 600.0
_listings = 0  # directories listed by this process (see listings())


def listings() -> int:
    """How many cache directories this process has listed: a test's proof that a path
    (a miss with SHARDCACHE_MAX_BYTES and the index) lists none."""
    return _listings


@dataclass(frozen=True)
class CacheEntry:
    """One published shard and what its metadata record says about it."""

    path: Path
    size: int
    last_used: float
    url: str | None = None  # credentials in it are redacted (``url_redacted``)
    etag: str | None = None
    md5: str | None = None
    url_redacted: bool = False
    recorded_size: int | None = None  # the size its metadata record gives
    verified: str | None = None  # how it was verified ("md5", ..., "size"); None: not recorded


@dataclass
class EvictReport:
    """What :meth:`ShardCache.evict` did: the shards it removed (least recently used first),
    the bytes freed and kept, and the shards it skipped because a reader had them open."""

    removed: list[CacheEntry] = field(default_factory=list)
    freed_bytes: int = 0
    kept_bytes: int = 0  # published bytes left, plus downloads in progress
    in_use: int = 0  # candidates skipped because a process had them pinned
    in_use_bytes: int = 0


def touch(layout: CacheLayout, path: Path, mtime: float) -> None:
    """Mark a hit as recently used (rate-limited by the caller's knowledge of ``mtime``)."""
    if time.time() - mtime > TOUCH_INTERVAL:
        with contextlib.suppress(OSError), layout.fs.directory(path.parent) as dir_fd:
            os.utime(path.name, dir_fd=dir_fd, follow_symlinks=False)


def list_dir(
    fs: SafeFS, path: Path, unreadable: list[tuple[Path, str]] | None = None
) -> list[tuple[str, os.stat_result]]:
    """The names in the cache directory ``path`` with their lstat, listed through its
    descriptor (:class:`SafeFS`); none if it is gone (a tmp cleaner), and entries removed
    while listing are left out. A directory that cannot be listed (or a link, or a foreign
    directory, on the way) raises CacheDirError, or is appended to ``unreadable``."""
    global _listings  # noqa: PLW0603
    _listings += 1
    try:
        with fs.directory(path) as dir_fd:
            listed = []
            for name in os.listdir(dir_fd):
                with contextlib.suppress(FileNotFoundError):
                    listed.append((name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)))
            return listed
    except (FileNotFoundError, NotADirectoryError):
        return []
    except CacheDirError as exc:
        if unreadable is None:
            raise
        unreadable.append((path, exc.message))
        return []
    except OSError as exc:
        if unreadable is None:
            raise dir_error(path, exc, "listing") from exc
        unreadable.append((path, f"{errno.errorcode.get(exc.errno or 0, '?')}: {exc.strerror}"))
        return []


def scan(
    layout: CacheLayout,
    with_meta: bool = False,
    unreadable: list[tuple[Path, str]] | None = None,
) -> tuple[list[CacheEntry], int]:
    """Published entries (oldest first) and the bytes of downloads in progress;
    ``with_meta`` also reads each entry's metadata record (URL, ETag). A directory that
    cannot be listed raises CacheDirError, or is appended to ``unreadable`` (with why)."""
    entries: list[CacheEntry] = []
    partial = 0
    # A download renamed into place while we list its directory can show up under both
    # names: count every file (inode) once.
    seen: set[int] = set()

    for bucket, bucket_st in list_dir(layout.fs, layout.data_dir, unreadable):
        if not stat.S_ISDIR(bucket_st.st_mode):
            continue
        with _meta_dir(layout, bucket, with_meta) as meta_fd:
            for name, st in list_dir(layout.fs, layout.data_dir / bucket, unreadable):
                if not stat.S_ISREG(st.st_mode) or st.st_ino in seen:
                    continue
                seen.add(st.st_ino)
                if is_temp_name(name):
                    partial += st.st_size
                    continue
                path = layout.data_dir / bucket / name
                meta = read_meta_at(meta_fd, f"{name}.json") if meta_fd is not None else {}
                entries.append(_entry(path, st, meta))
    entries.sort(key=lambda e: e.last_used)
    return entries, partial


@contextlib.contextmanager
def _meta_dir(layout: CacheLayout, bucket: str, wanted: bool) -> Iterator[int | None]:
    """A descriptor of ``.meta/<bucket>`` (None if not ``wanted``, missing or unusable)."""
    if not wanted:
        yield None
        return
    try:
        ctx = layout.fs.directory(layout.meta_dir / bucket)
        fd = ctx.__enter__()
    except (OSError, CacheDirError):
        yield None
        return
    try:
        yield fd
    finally:
        ctx.__exit__(None, None, None)


def _entry(path: Path, st: os.stat_result, meta: dict[str, Any]) -> CacheEntry:
    return CacheEntry(
        path=path,
        size=st.st_size,
        last_used=st.st_mtime,
        url=meta.get("url"),
        etag=meta.get("etag"),
        md5=meta.get("md5"),
        url_redacted=bool(meta.get("url_redacted")),
        recorded_size=_int_or_none(meta.get("size")),
        verified=meta["verified"] if isinstance(meta.get("verified"), str) else None,
    )


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def remove(layout: CacheLayout, path: Path) -> bool:
    """Remove a published shard, its metadata and its sample record unless a process has
    it pinned."""
    try:
        fd = layout.fs.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except CacheDirError:
        raise
    except OSError as exc:  # a link planted at a shard's name, no permission, ...
        raise dir_error(path, exc, "opening") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # pinned by a reader
        with contextlib.suppress(FileNotFoundError):
            layout.fs.unlink(path)
        for record in (layout.meta_path(path), layout.samples_record_path(path)):
            with contextlib.suppress(FileNotFoundError):
                layout.fs.unlink(record)
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def evict_lock(layout: CacheLayout, timeout: float = EVICT_LOCK_TIMEOUT) -> Iterator[None]:
    """Hold the scope's eviction lock (``.locks/evict.lock``): evictions and the space
    reservations of new downloads are serialised by it, so no two processes count the
    same free space. Survives its directory being removed meanwhile."""
    path = layout.evict_lock_path
    start = time.monotonic()
    delay = 0.001
    vanished = 0
    while True:
        try:
            layout.make_dir(path.parent)
            fd = try_flock(layout.fs, path)
        except CacheDirError:
            raise
        except FileNotFoundError as exc:  # its directory was removed under us: make it again
            vanished += 1
            if vanished > 20:
                raise lock_file_error(path, None, exc, vanished) from exc
            continue
        except OSError as exc:
            raise lock_file_error(path, None, exc, 1) from exc
        if fd is not None:
            break
        waited = time.monotonic() - start
        if waited >= timeout:
            raise LockTimeout(
                f"timed out after {waited:.0f}s waiting for the eviction lock {path}: another "
                "process of this cache scope is evicting or reserving space and has not "
                "finished. Look for a hung process ('shardcache status'), or kill it.",
                path=str(path),
                elapsed=waited,
            )
        time.sleep(min(delay, max(0.0, timeout - waited)))
        delay = min(delay * 2, 0.05)
    try:
        yield
    finally:
        os.close(fd)


def evict_lru(layout: CacheLayout, max_bytes: int, reserve: int = 0) -> EvictReport:
    """Remove least-recently-used shards until published + in-progress + ``reserve`` bytes
    fit in ``max_bytes`` (or nothing evictable is left), under the eviction lock."""
    with evict_lock(layout):
        return evict_locked(layout, max_bytes, reserve)


def evict_locked(layout: CacheLayout, max_bytes: int, reserve: int = 0) -> EvictReport:
    """:func:`evict_lru` for a caller that already holds :func:`evict_lock`."""
    entries, partial = scan(layout)
    used = partial + sum(e.size for e in entries)
    report = EvictReport()
    for entry in entries:
        if used + reserve <= max_bytes:
            break
        meta = read_meta(layout, entry.path)  # for the report: which URL went
        if remove(layout, entry.path):
            report.removed.append(
                dataclasses.replace(entry, url=meta.get("url"), etag=meta.get("etag"))
            )
            report.freed_bytes += entry.size
            used -= entry.size
        else:
            report.in_use += 1
            report.in_use_bytes += entry.size
    report.kept_bytes = used
    log_evicted(layout, report, max_bytes)
    return report


def log_evicted(layout: CacheLayout, report: EvictReport, max_bytes: int) -> None:
    if report.removed:
        logger.info(
            "evicted %d shards (%d bytes) from %s to stay within %d bytes",
            len(report.removed),
            report.freed_bytes,
            layout.scope_dir,
            max_bytes,
        )
