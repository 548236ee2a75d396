"""Inspecting and repairing a cache directory: ``status`` and ``clean`` (``verify``, which
checks cached shards' content, is :mod:`shardcache._ops.verify`), and what ``clean`` and
``evict`` would remove (``--dry-run``), removing nothing.

``status`` walks a scope directory once (counts, disk, locks held, temp and record files);
what counts as stale or orphan, and what never does, is :mod:`shardcache._ops.maintenance_stale`'s
judgement; ``clean`` removes exactly those, judging each again right before removing it. The
reports are :mod:`shardcache._ops.maintenance_reports`'.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from .._base.errors import CacheDirError
from .._base.redact import get_logger
from .._base.safefs import SafeFS
from .._cache.shard_cache import ShardCache
from .._config.settings import Settings
from .._disk.layout import CacheLayout, lease_step_of, parse_scope_dir, parse_temp_name
from .._locking.lease import remove_lease_if_unchanged
from .._locking.records import holder_verdict, read_owner, read_record
from .._store.eviction import EvictReport, list_dir, scan
from .._store.pins import is_held
from .maintenance_reports import (
    KIND_LABELS,
    UNKNOWN,
    CleanReport,
    CleanSummary,
    HeldLock,
    StatusReport,
    StatusSummary,
    method_counts,
)
from .maintenance_stale import (
    file_size,
    judge_lease,
    judge_lock_leftover,
    judge_record,
    judge_temp,
    rejudge,
)

logger = get_logger(__name__)


def require_scope_dir(settings: Settings) -> None:
    """Raise :class:`CacheDirError` unless the scope directory of ``settings`` exists
    (``status``, ``clean``, ``evict`` and ``verify`` look at a cache; they never make one),
    saying what is missing and which scope directories the root holds instead."""
    root, scope_dir = settings.cache_dir, settings.scope_dir
    for path in (root, scope_dir):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            break
        except OSError as exc:
            raise CacheDirError(
                f"cannot look at the cache directory {path}: {exc.strerror or exc}; expected "
                "a directory this user can read: fix its permissions, or give another "
                "--cache-dir",
                path=str(path),
                errno=exc.errno,
            ) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise CacheDirError(
                f"{path} is not a directory (a {_kind(st.st_mode)}); expected the cache root "
                "SHARDCACHE_DIR / --cache-dir names, holding rank-N and node directories: "
                "give the right --cache-dir",
                path=str(path),
            )
    else:
        return
    sources = settings.sources
    why = (
        f"cache root from {sources.get('cache_dir', 'default')}, {settings.scope} scope from "
        f"{sources.get('scope', 'default')}"
    )
    if path == root:
        where = "check --cache-dir / SHARDCACHE_DIR, or warm it first"
    elif others := [name for name, *_ in _scopes(root)]:
        where = (
            f"the cache root holds {', '.join(others)}: pick one with --scope node or --rank N, "
            "or give --all"
        )
    else:
        where = "the cache root holds no scope directory: nothing has been cached there yet"
    raise CacheDirError(
        f"no cache at {scope_dir}: {path} does not exist ({why}); {where}",
        path=str(scope_dir),
    )


def _kind(mode: int) -> str:
    return "regular file" if stat.S_ISREG(mode) else "special file"


def _scopes(root: Path) -> list[tuple[str, str, int]]:
    """(name, scope, rank) of every scope directory under ``root``: ``node`` first, then
    ``rank-N`` by rank; symbolic links are not followed. CacheDirError if it cannot be
    listed."""
    try:
        names = [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError as exc:
        raise CacheDirError(
            f"cannot list the cache root {root}: {exc.strerror or exc}; expected the directory "
            "SHARDCACHE_DIR / --cache-dir names, holding rank-N and node directories",
            path=str(root),
            errno=exc.errno,
        ) from exc
    scopes = [(name, *parsed) for name in names if (parsed := parse_scope_dir(name)) is not None]
    return sorted(scopes, key=lambda item: (item[1] != "node", item[2]))


def scope_caches(settings: Settings) -> list[ShardCache]:
    """A cache for every scope directory under ``settings.cache_dir`` (:func:`_scopes`)."""
    return [
        ShardCache(settings=settings.replace(scope=scope, rank=rank))
        for _name, scope, rank in _scopes(settings.cache_dir)
    ]


def status_all(settings: Settings, *, list_shards: bool = False) -> StatusSummary:
    """:func:`status` of every scope directory under ``settings.cache_dir``."""
    return StatusSummary(
        settings.cache_dir, [status(c, list_shards=list_shards) for c in scope_caches(settings)]
    )


def status(cache: ShardCache, *, list_shards: bool = False) -> StatusReport:
    """Entries (and how each was verified, from its record; each one with
    ``list_shards``), disk, locks held and by whom, stale locks and orphan files of
    ``cache`` (:func:`require_scope_dir` first)."""
    require_scope_dir(cache.settings)
    layout = cache.layout
    report = StatusReport(scope_dir=layout.scope_dir)
    # Records read for how each shard was verified (older records, or none: "unknown").
    entries = scan(layout, with_meta=True, unreadable=report.unreadable)[0]
    report.entries = len(entries)
    if list_shards:
        report.shards = sorted(entries, key=lambda e: (e.url or "", str(e.path)))
    report.verified = method_counts(e.verified or UNKNOWN for e in entries)
    report.bytes = sum(e.size for e in entries)
    with _DirFds(layout.fs) as dirs:
        report.in_use = sum(1 for e in entries if is_held(layout.fs, e.path, dirs.fd(e.path)))
    with contextlib.suppress(OSError):
        usage = shutil.disk_usage(layout.scope_dir)
        report.disk_total, report.disk_free = usage.total, usage.free
    name = layout.scope_dir.name
    with contextlib.suppress(CacheDirError):
        report.other_scopes = [n for n, *_ in _scopes(layout.scope_dir.parent) if n != name]
    _scan_locks(layout, report)
    for path in _files(layout.fs, layout.data_dir, report.unreadable):
        if parse_temp_name(path.name) is None:
            continue
        orphan = judge_temp(layout.fs, path)
        if orphan is not None:
            report.orphans.append(orphan)
        else:
            report.downloads += 1
            report.download_bytes += file_size(layout.fs, path)
    published = {e.path for e in entries}
    for records in (layout.meta_dir, layout.samples_dir):
        for path in _files(layout.fs, records, report.unreadable):
            if layout.data_path_of_record(path) in published:
                continue  # its shard was there a moment ago: not an orphan (clean judges again)
            orphan = judge_record(layout, path)
            if orphan is not None:
                report.orphans.append(orphan)
    report.unreadable = sorted(set(report.unreadable))
    return report


def _scan_locks(layout: CacheLayout, report: StatusReport) -> None:
    with _DirFds(layout.fs) as dirs:
        for path in _files(layout.fs, layout.locks_dir, report.unreadable):
            _judge_lock_file(layout, report, path, dirs)


def _judge_lock_file(layout: CacheLayout, report: StatusReport, path: Path, dirs: _DirFds) -> None:
    name = path.name
    if name.endswith(".lock"):
        if not is_held(layout.fs, path, dirs.fd(path)):
            return
        holder = read_owner(layout.fs, path) if _is_shard_lock(path) else None
        verdict, why = holder_verdict(holder) if holder else ("unknown", "no owner record")
        report.locks_held.append(HeldLock(path, "flock", holder, verdict, why))
    elif name.endswith(".lease"):
        stale = judge_lease(layout.fs, path)
        if stale is not None:
            report.stale_locks.append(stale)
            return
        record = read_record(layout.fs, path)[1]
        verdict, why = holder_verdict(record)
        report.locks_held.append(HeldLock(path, "lease", record, verdict, why))
    elif lease_step_of(name) is not None:
        stale = judge_lock_leftover(layout.fs, path)
        if stale is not None:
            report.stale_locks.append(stale)


def clean(cache: ShardCache, *, dry_run: bool = False) -> CleanReport:
    """Remove what :func:`status` calls stale or orphan, judging each item again first
    (``dry_run``: report what that finds, remove nothing)."""
    layout = cache.layout
    found = status(cache)
    report = CleanReport(
        scope_dir=layout.scope_dir,
        live_locks=len(found.locks_held),
        live_downloads=found.downloads,
        dry_run=dry_run,
    )
    # Temp files first: a metadata record is an orphan only once no live download remains.
    items = [i for i in found.orphans if i.kind == "part"] + found.stale_locks
    items += [i for i in found.orphans if i.kind != "part"]
    for item in items:
        again = rejudge(layout, item)
        if again is None:
            report.kept.append((item, "no longer stale when checked again"))
            continue
        if dry_run:
            report.removed.append(again)
            continue
        try:
            if again.kind == "lease":
                assert again.raw is not None
                removed = remove_lease_if_unchanged(layout.fs, again.path, again.raw)
            else:
                layout.fs.unlink(again.path)
                removed = True
        except FileNotFoundError:
            removed = False
        except OSError as exc:
            report.failed.append((again, str(exc)))
            continue
        if removed:
            logger.info("removed %s %s: %s", KIND_LABELS[again.kind], again.path, again.reason)
            report.removed.append(again)
        else:
            report.kept.append((again, "changed or gone when removing it"))
    return report


def clean_all(settings: Settings, *, dry_run: bool = False) -> CleanSummary:
    """:func:`clean` of every scope directory under ``settings.cache_dir``."""
    return CleanSummary(
        settings.cache_dir, [clean(c, dry_run=dry_run) for c in scope_caches(settings)]
    )


def evict_preview(cache: ShardCache, max_bytes: int) -> EvictReport:
    """What ``cache.evict(max_bytes)`` would remove now, removing nothing: by the same rule
    (least recently used first until shards plus downloads in progress fit in
    ``max_bytes``; a shard a reader holds is skipped), from a listing of the directory."""
    require_scope_dir(cache.settings)
    layout = cache.layout
    entries, partial = scan(layout, with_meta=True)
    used = partial + sum(e.size for e in entries)
    report = EvictReport()
    with _DirFds(layout.fs) as dirs:
        for entry in entries:
            if used <= max_bytes:
                break
            if is_held(layout.fs, entry.path, dirs.fd(entry.path)):
                report.in_use += 1
                report.in_use_bytes += entry.size
                continue
            report.removed.append(entry)
            report.freed_bytes += entry.size
            used -= entry.size
    report.kept_bytes = used
    return report


# ----------------------------------------------------------------------------- helpers


class _DirFds:
    """Descriptors of the directories a walk over many files visits, each opened once
    through :class:`SafeFS` and kept until the end (files are then opened relative to
    them: one walk from the root per directory, not per file)."""

    def __init__(self, fs: SafeFS) -> None:
        self._fs = fs
        self._stack = contextlib.ExitStack()
        self._fds: dict[Path, int | None] = {}

    def __enter__(self) -> _DirFds:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def fd(self, path: Path) -> int | None:
        """A descriptor of ``path``'s directory; None if it cannot be opened (the caller
        then takes the walk, which says what is wrong)."""
        parent = path.parent
        if parent not in self._fds:
            try:
                self._fds[parent] = self._stack.enter_context(self._fs.directory(parent))
            except (OSError, CacheDirError):
                self._fds[parent] = None
        return self._fds[parent]


def _files(fs: SafeFS, root: Path, unreadable: list[tuple[Path, str]]) -> Iterator[Path]:
    """Files directly in ``root`` and in its subdirectories (one level: ``<hh>/``); a
    directory that exists but cannot be listed is appended to ``unreadable``."""
    for name, st in list_dir(fs, root, unreadable):
        if stat.S_ISDIR(st.st_mode):
            for sub, sub_st in list_dir(fs, root / name, unreadable):
                if stat.S_ISREG(sub_st.st_mode):
                    yield root / name / sub
        elif stat.S_ISREG(st.st_mode):
            yield root / name


def _is_shard_lock(path: Path) -> bool:
    return len(path.stem) == 64 and all(c in "0123456789abcdef" for c in path.stem)


__all__ = [
    "clean",
    "clean_all",
    "evict_preview",
    "require_scope_dir",
    "scope_caches",
    "status",
    "status_all",
]
