"""Inspecting and repairing a cache directory: ``status`` and ``clean`` (``verify``, which
checks cached shards' content, is :mod:`shardcache._verify`).

What counts as stale (``clean`` removes exactly these, judging each again right before
removing it):

* a lease (``.locks/<hh>/<hash>.lease``) whose holder is provably dead (same host and
  boot, pid gone or reused), or that was written on another host and has not changed
  for ``OTHER_HOST_AGE`` (24 h);
* leftovers of lease operations (``<hash>.<token>.claim|.broken|.released``) whose
  process is dead (or, unreadable, older than ``OTHER_HOST_AGE``);
* a download's temp file (``.<name>.<host>.<pid>.<token>.part``) from this host whose pid
  no longer exists or now belongs to a process started after the file was last written;
  from another host, one untouched for ``OTHER_HOST_AGE``;
* a metadata record whose shard is gone and that no live download is about to publish,
  and a half-written metadata temp file older than ``META_TMP_AGE``;
* the same for a sample record (``.samples/``: the sample offsets learned of a cached
  shard), whose shard is gone.

Never touched: ``.lock`` files (deleting one lets two holders in), ``.owner`` records, a
lease of a live (or unjudgeable) holder, a temp file of a living process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._cache import ShardCache
from ._config import Settings
from ._errors import CacheDirError
from ._eviction import list_dir, scan
from ._identity import hostname, start_ticks, start_time
from ._layout import (
    LEASE_STEPS,
    CacheLayout,
    host_tag,
    lease_step_of,
    meta_temp_pid,
    parse_scope_dir,
    parse_temp_name,
)
from ._lock_lease import remove_lease_if_unchanged
from ._lock_records import describe_holder, holder_verdict, read_owner, read_record
from ._pins import is_held
from ._redact import get_logger
from ._safefs import SafeFS
from ._units import format_bytes

logger = get_logger(__name__)

OTHER_HOST_AGE = 24 * 3600.0  # a file of another host untouched this long is abandoned
META_TMP_AGE = 3600.0  # a metadata write takes milliseconds: an hour-old temp is abandoned
_CLOCK_SLACK = 2.0  # seconds: process start times from /proc are coarse

KIND_LABELS = {
    "lease": "stale lease",
    **dict.fromkeys(LEASE_STEPS, "lease leftover"),
    "part": "orphan download",
    "meta": "orphan metadata",
    "meta-tmp": "orphan metadata temp",
    "samples": "orphan sample record",
}


# ----------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class HeldLock:
    """A lock some process holds right now."""

    path: Path
    mode: str  # "flock" or "lease"
    holder: dict[str, Any] | None
    verdict: str  # "alive" | "dead" | "unknown" (of the recorded holder)
    why: str

    @property
    def url(self) -> str | None:
        return None if self.holder is None else self.holder.get("url")

    def describe(self) -> str:
        what = self.url or self.path.name
        holder = describe_holder(self.holder) if self.holder else "no owner record yet"
        return f"{what} ({self.mode}): {holder}; {self.verdict} ({self.why})"

    def as_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "mode": self.mode,
            "url": self.url,
            "holder": self.holder,
            "verdict": self.verdict,
            "why": self.why,
        }


@dataclass(frozen=True)
class Leftover:
    """A stale lock file or an orphan temp/metadata file, and why it is one."""

    path: Path
    kind: str  # a key of KIND_LABELS
    size: int
    reason: str
    raw: bytes | None = field(default=None, repr=False, compare=False)  # a judged lease

    def describe(self, root: Path) -> str:
        try:
            shown: Path | str = self.path.relative_to(root)
        except ValueError:
            shown = self.path
        return f"{KIND_LABELS[self.kind]}: {shown} ({format_bytes(self.size)}; {self.reason})"

    def as_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "size": self.size,
            "reason": self.reason,
        }


@dataclass
class StatusReport:
    """The state of one cache scope directory."""

    scope_dir: Path
    entries: int = 0
    bytes: int = 0
    in_use: int = 0  # shards pinned by readers right now
    downloads: int = 0  # temp files of live downloads
    download_bytes: int = 0
    disk_total: int | None = None  # None: the file system could not be asked
    disk_free: int | None = None
    locks_held: list[HeldLock] = field(default_factory=list)
    stale_locks: list[Leftover] = field(default_factory=list)
    orphans: list[Leftover] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # (directory, why)
    other_scopes: list[str] = field(default_factory=list)  # sibling scope directories

    def as_json(self) -> dict[str, Any]:
        return {
            "scope_dir": str(self.scope_dir),
            "other_scopes": self.other_scopes,
            "unreadable": unreadable_json(self.unreadable),
            "entries": self.entries,
            "bytes": self.bytes,
            "in_use": self.in_use,
            "downloads_in_progress": self.downloads,
            "download_bytes": self.download_bytes,
            "disk_total": self.disk_total,
            "disk_free": self.disk_free,
            "locks_held": [lock.as_json() for lock in self.locks_held],
            "stale_locks": [item.as_json() for item in self.stale_locks],
            "orphans": [item.as_json() for item in self.orphans],
        }

    def format(self) -> str:
        root = self.scope_dir
        if self.disk_free is None or self.disk_total is None:
            disk = "unknown (the file system did not say)"
        else:
            disk = f"{format_bytes(self.disk_free)} free of {format_bytes(self.disk_total)}"
        lines = [f"cache       {root}"]
        if self.other_scopes:
            lines.append(
                f"also here   {', '.join(self.other_scopes)} (other scopes of {root.parent}: "
                "--scope node, --rank N, or --all for every one)"
            )
        lines += [
            f"entries     {self.entries} shards, {format_bytes(self.bytes)}"
            f" ({self.in_use} in use by readers)",
            f"downloads   {self.downloads} in progress ({format_bytes(self.download_bytes)})",
            f"disk        {disk}",
            f"locks held  {len(self.locks_held)}",
        ]
        lines += [f"  {lock.describe()}" for lock in self.locks_held]
        lines.append(f"stale locks {len(self.stale_locks)}")
        lines += [f"  {item.describe(root)}" for item in self.stale_locks]
        lines.append(f"orphans     {len(self.orphans)}")
        lines += [f"  {item.describe(root)}" for item in self.orphans]
        if self.stale_locks or self.orphans:
            lines.append("run 'shardcache clean' to remove the stale locks and orphans")
        lines += unreadable_lines(self.unreadable)
        return "\n".join(lines)


@dataclass
class CleanReport:
    """What ``clean`` removed, and what it found no longer stale when it looked again."""

    scope_dir: Path
    removed: list[Leftover] = field(default_factory=list)
    kept: list[tuple[Leftover, str]] = field(default_factory=list)
    failed: list[tuple[Leftover, str]] = field(default_factory=list)
    live_locks: int = 0
    live_downloads: int = 0

    @property
    def freed_bytes(self) -> int:
        return sum(item.size for item in self.removed)

    def as_json(self) -> dict[str, Any]:
        return {
            "scope_dir": str(self.scope_dir),
            "removed": [item.as_json() for item in self.removed],
            "freed_bytes": self.freed_bytes,
            "kept": [{**item.as_json(), "why": why} for item, why in self.kept],
            "failed": [{**item.as_json(), "error": err} for item, err in self.failed],
            "live_locks_left_alone": self.live_locks,
            "live_downloads_left_alone": self.live_downloads,
        }

    def format(self) -> str:
        root = self.scope_dir
        lines = [f"clean {root}: removed {len(self.removed)} ({format_bytes(self.freed_bytes)})"]
        lines += [f"  {item.describe(root)}" for item in self.removed]
        for item, why in self.kept:
            lines.append(f"  kept {item.describe(root)}: {why}")
        for item, err in self.failed:
            lines.append(f"  could not remove {item.describe(root)}: {err}")
        lines.append(
            f"left alone: {self.live_locks} held lock(s), {self.live_downloads} download(s) "
            "in progress"
        )
        return "\n".join(lines)


@dataclass
class CleanSummary:
    """``clean --all``: what was cleaned in every scope directory under a cache root."""

    root: Path
    reports: list[CleanReport] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(r.failed for r in self.reports)

    def as_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "scopes": [r.as_json() for r in self.reports]}

    def format(self) -> str:
        if not self.reports:
            return f"cache root  {self.root}\nno scope directories (rank-N, node) under it"
        removed = [item for r in self.reports for item in r.removed]
        freed = format_bytes(sum(item.size for item in removed))
        lines = [
            f"cache root  {self.root}: {len(self.reports)} scope directories, removed "
            f"{len(removed)} ({freed})"
        ]
        return "\n".join(lines + [r.format() for r in self.reports])


# ------------------------------------------------------------------------------ status


@dataclass
class StatusSummary:
    """``status --all``: every scope directory (``rank-*``, ``node``) under a cache root."""

    root: Path
    reports: list[StatusReport] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"root": str(self.root), "scopes": [r.as_json() for r in self.reports]}

    def format(self) -> str:
        if not self.reports:
            return f"cache root  {self.root}\nno scope directories (rank-N, node) under it"
        header = ("scope", "shards", "bytes", "in use", "downloads", "locks", "stale", "orphans")
        rows = [header] + [
            (
                r.scope_dir.name,
                str(r.entries),
                format_bytes(r.bytes),
                str(r.in_use),
                str(r.downloads),
                str(len(r.locks_held)),
                str(len(r.stale_locks)),
                str(len(r.orphans)),
            )
            for r in self.reports
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [f"cache root  {self.root}: {len(self.reports)} scope directories"]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        for report in self.reports:
            root, name = report.scope_dir, report.scope_dir.name
            lines += [f"{name}: {lock.describe()}" for lock in report.locks_held]
            lines += [f"{name}: {item.describe(root)}" for item in report.stale_locks]
            lines += [f"{name}: {item.describe(root)}" for item in report.orphans]
            lines += [f"{name}: {line.strip()}" for line in unreadable_lines(report.unreadable)]
        dirty = [r.scope_dir.name for r in self.reports if r.stale_locks or r.orphans]
        if dirty:
            lines.append(
                f"run 'shardcache clean --all' to remove the stale locks and orphans of "
                f"{', '.join(dirty)}"
            )
        return "\n".join(lines)


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


def status_all(settings: Settings) -> StatusSummary:
    """:func:`status` of every scope directory under ``settings.cache_dir``."""
    return StatusSummary(settings.cache_dir, [status(c) for c in scope_caches(settings)])


def status(cache: ShardCache) -> StatusReport:
    """Entries, disk, locks held and by whom, stale locks and orphan files of ``cache``
    (:func:`require_scope_dir` first)."""
    require_scope_dir(cache.settings)
    layout = cache.layout
    report = StatusReport(scope_dir=layout.scope_dir)
    entries = scan(layout, unreadable=report.unreadable)[0]  # counts only: no records read
    report.entries = len(entries)
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
        orphan = _judge_temp(layout.fs, path)
        if orphan is not None:
            report.orphans.append(orphan)
        else:
            report.downloads += 1
            report.download_bytes += _size(layout.fs, path)
    published = {e.path for e in entries}
    for records in (layout.meta_dir, layout.samples_dir):
        for path in _files(layout.fs, records, report.unreadable):
            if layout.data_path_of_record(path) in published:
                continue  # its shard was there a moment ago: not an orphan (clean judges again)
            orphan = _judge_record(layout, path)
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
        stale = _judge_lease(layout.fs, path)
        if stale is not None:
            report.stale_locks.append(stale)
            return
        record = read_record(layout.fs, path)[1]
        verdict, why = holder_verdict(record)
        report.locks_held.append(HeldLock(path, "lease", record, verdict, why))
    elif lease_step_of(name) is not None:
        stale = _judge_lock_leftover(layout.fs, path)
        if stale is not None:
            report.stale_locks.append(stale)


def clean(cache: ShardCache) -> CleanReport:
    """Remove what :func:`status` calls stale or orphan, judging each item again first."""
    layout = cache.layout
    found = status(cache)
    report = CleanReport(
        scope_dir=layout.scope_dir,
        live_locks=len(found.locks_held),
        live_downloads=found.downloads,
    )
    # Temp files first: a metadata record is an orphan only once no live download remains.
    items = [i for i in found.orphans if i.kind == "part"] + found.stale_locks
    items += [i for i in found.orphans if i.kind != "part"]
    for item in items:
        again = _rejudge(layout, item)
        if again is None:
            report.kept.append((item, "no longer stale when checked again"))
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


def clean_all(settings: Settings) -> CleanSummary:
    """:func:`clean` of every scope directory under ``settings.cache_dir``."""
    return CleanSummary(settings.cache_dir, [clean(c) for c in scope_caches(settings)])


def _rejudge(layout: CacheLayout, item: Leftover) -> Leftover | None:
    if item.kind == "lease":
        return _judge_lease(layout.fs, item.path)
    if item.kind in LEASE_STEPS:
        return _judge_lock_leftover(layout.fs, item.path)
    if item.kind == "part":
        return _judge_temp(layout.fs, item.path)
    return _judge_record(layout, item.path)


# ---------------------------------------------------------------------------- judging


def _judge_lease(fs: SafeFS, path: Path) -> Leftover | None:
    raw, record = read_record(fs, path)
    if raw is None:
        return None
    verdict, why = holder_verdict(record)
    if verdict == "dead":
        assert record is not None
        reason = f"lock of {record.get('url')}, holder pid {record.get('pid')}: {why}"
        return Leftover(path, "lease", len(raw), reason, raw)
    age = _age(fs, path)
    if record is not None and record.get("host") != hostname() and age > OTHER_HOST_AGE:
        reason = (
            f"lock of {record.get('url')}, holder on host {record.get('host')}, unchanged "
            f"for {age / 3600:.0f} h"
        )
        return Leftover(path, "lease", len(raw), reason, raw)
    return None


def _judge_lock_leftover(fs: SafeFS, path: Path) -> Leftover | None:
    raw, record = read_record(fs, path)
    if raw is None:
        return None
    kind = lease_step_of(path.name)
    assert kind is not None, path
    if record is None:
        age = _age(fs, path)
        if age > OTHER_HOST_AGE:
            return Leftover(path, kind, len(raw), f"unreadable, untouched for {age / 3600:.0f} h")
        return None
    verdict, why = holder_verdict(record)
    if verdict == "dead":
        reason = f"lock of {record.get('url')}, pid {record.get('pid')}: {why}"
        return Leftover(path, kind, len(raw), reason)
    age = _age(fs, path)
    if record.get("host") != hostname() and age > OTHER_HOST_AGE:
        return Leftover(
            path, kind, len(raw), f"host {record.get('host')}, untouched for {age / 3600:.0f} h"
        )
    return None


def _judge_temp(fs: SafeFS, path: Path) -> Leftover | None:
    """An orphan download temp file, or None while its writer may be alive."""
    temp = parse_temp_name(path.name)
    if temp is None:
        return None
    try:
        st = fs.lstat(path)
    except OSError:
        return None
    if temp.host != host_tag():
        age = time.time() - st.st_mtime
        if age > OTHER_HOST_AGE:
            reason = f"written on host {temp.host}, untouched for {age / 3600:.0f} h"
            return Leftover(path, "part", st.st_size, reason)
        return None
    ticks = start_ticks(temp.pid)
    if ticks is None:
        return Leftover(path, "part", st.st_size, f"pid {temp.pid} no longer exists")
    started = start_time(ticks)
    if started is not None and started > st.st_mtime + _CLOCK_SLACK:
        reason = f"pid {temp.pid} now belongs to a process started after the file was written"
        return Leftover(path, "part", st.st_size, reason)
    return None


def _judge_record(layout: CacheLayout, path: Path) -> Leftover | None:
    """A metadata or sample record (or a temp file of one) that no shard needs."""
    fs = layout.fs
    writer = meta_temp_pid(path.name)
    if writer is not None:
        age = _age(fs, path)
        if age > META_TMP_AGE:
            reason = f"unfinished record write of pid {writer}, {age / 60:.0f} min old"
            return Leftover(path, "meta-tmp", _size(fs, path), reason)
        return None
    if not path.name.endswith(".json") or path.name.startswith("."):
        return None
    kind = "samples" if path.parent.parent == layout.samples_dir else "meta"
    data = layout.data_path_of_record(path)
    if _exists(fs, data):  # the common case, one lstat (listing the bucket costs N/256)
        return None
    # Order matters: a download writes the record, then renames its temp file into place;
    # so no live download, then still no shard (it may have been renamed meanwhile).
    if _live_download_of(fs, data):
        return None
    if _exists(fs, data) or not _exists(fs, path):
        return None
    return Leftover(path, kind, _size(fs, path), "its shard is no longer in the cache")


def _live_download_of(fs: SafeFS, data: Path) -> bool:
    for name, _ in list_dir(fs, data.parent, []):
        temp = parse_temp_name(name)
        live = temp is not None and temp.final == data.name
        if live and _judge_temp(fs, data.parent / name) is None:
            return True
    return False


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


def unreadable_json(unreadable: list[tuple[Path, str]]) -> list[dict[str, str]]:
    return [{"path": str(path), "error": why} for path, why in unreadable]


def unreadable_lines(unreadable: list[tuple[Path, str]]) -> list[str]:
    if not unreadable:
        return []
    lines = [f"unreadable  {len(unreadable)} directories (not examined; fix their permissions):"]
    return lines + [f"  {path}: {why}" for path, why in unreadable]


def _is_shard_lock(path: Path) -> bool:
    return len(path.stem) == 64 and all(c in "0123456789abcdef" for c in path.stem)


def _size(fs: SafeFS, path: Path) -> int:
    try:
        return fs.lstat(path).st_size
    except OSError:
        return 0


def _age(fs: SafeFS, path: Path) -> float:
    try:
        return time.time() - fs.lstat(path).st_mtime
    except OSError:
        return 0.0


def _exists(fs: SafeFS, path: Path) -> bool:
    try:
        fs.lstat(path)
    except OSError:
        return False
    return True


__all__ = [
    "META_TMP_AGE",
    "OTHER_HOST_AGE",
    "CleanReport",
    "HeldLock",
    "Leftover",
    "StatusReport",
    "clean",
    "require_scope_dir",
    "status",
]
