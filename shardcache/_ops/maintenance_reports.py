"""What ``status`` and ``clean`` report: the locks held and by whom, the stale lock files and
orphan files found (each with its kind and why it is one), per scope directory and for every
scope under a cache root; each as text for a person and as JSON."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._base.units import format_bytes
from .._disk.layout import LEASE_STEPS
from .._locking.records import describe_holder
from .._store.eviction import CacheEntry

KIND_LABELS = {
    "lease": "stale lease",
    **dict.fromkeys(LEASE_STEPS, "lease leftover"),
    "part": "orphan download",
    "meta": "orphan metadata",
    "meta-tmp": "orphan metadata temp",
    "samples": "orphan sample record",
}

UNKNOWN = "unknown"  # a shard whose record does not say how it was verified (older, or none)


SIZE_NOTE = (
    "size: checked by their size only (the store described no checksum, a local file or a "
    "pipe: command, or SHARDCACHE_VERIFY=size)"
)


def method_counts(methods: Iterable[str]) -> dict[str, int]:
    """Shards counted by verification method, most first (then by name)."""
    return dict(sorted(Counter(methods).items(), key=lambda item: (-item[1], item[0])))


def verified_text(methods: dict[str, int]) -> str:
    """``md5-parts 3, size 1, unknown 2``: shards by verification method."""
    return ", ".join(f"{method} {n}" for method, n in methods.items()) or "none"


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
    verified: dict[str, int] = field(default_factory=dict)  # shards by verification method
    downloads: int = 0  # temp files of live downloads
    download_bytes: int = 0
    disk_total: int | None = None  # None: the file system could not be asked
    disk_free: int | None = None
    locks_held: list[HeldLock] = field(default_factory=list)
    stale_locks: list[Leftover] = field(default_factory=list)
    orphans: list[Leftover] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # (directory, why)
    other_scopes: list[str] = field(default_factory=list)  # sibling scope directories
    shards: list[CacheEntry] | None = None  # each cached shard (``status --list``)

    def as_json(self) -> dict[str, Any]:
        listed = {} if self.shards is None else {"shards": [_shard_json(e) for e in self.shards]}
        return {
            "scope_dir": str(self.scope_dir),
            **listed,
            "other_scopes": self.other_scopes,
            "unreadable": unreadable_json(self.unreadable),
            "entries": self.entries,
            "bytes": self.bytes,
            "in_use": self.in_use,
            "verified": self.verified,
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
            *(f"  {_shard_line(entry)}" for entry in self.shards or ()),
            f"verified    {verified_text(self.verified)}",
            *([f"  {SIZE_NOTE}"] if self.verified.get("size") else []),
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
    dry_run: bool = False  # ``removed``: what would be removed; nothing was

    @property
    def freed_bytes(self) -> int:
        return sum(item.size for item in self.removed)

    def as_json(self) -> dict[str, Any]:
        return {
            "scope_dir": str(self.scope_dir),
            "dry_run": self.dry_run,
            "removed": [item.as_json() for item in self.removed],
            "freed_bytes": self.freed_bytes,
            "kept": [{**item.as_json(), "why": why} for item, why in self.kept],
            "failed": [{**item.as_json(), "error": err} for item, err in self.failed],
            "live_locks_left_alone": self.live_locks,
            "live_downloads_left_alone": self.live_downloads,
        }

    def format(self) -> str:
        root = self.scope_dir
        done = "would remove" if self.dry_run else "removed"
        lines = [f"clean {root}: {done} {len(self.removed)} ({format_bytes(self.freed_bytes)})"]
        if self.dry_run:
            lines[0] += "; --dry-run: nothing removed"
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
        done = "would remove" if any(r.dry_run for r in self.reports) else "removed"
        lines = [
            f"cache root  {self.root}: {len(self.reports)} scope directories, {done} "
            f"{len(removed)} ({freed})"
        ]
        return "\n".join(lines + [r.format() for r in self.reports])


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
            lines += [f"{name}: {_shard_line(entry)}" for entry in report.shards or ()]
            if report.verified:
                lines.append(f"{name}: verified {verified_text(report.verified)}")
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


def _shard_json(entry: CacheEntry) -> dict[str, Any]:
    return {
        "url": entry.url,
        "path": str(entry.path),
        "size": entry.size,
        "last_used": entry.last_used,
        "verified": entry.verified,
    }


def _shard_line(entry: CacheEntry) -> str:
    used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.last_used))
    return f"{entry.url or entry.path} ({format_bytes(entry.size)}, last used {used})"


def unreadable_json(unreadable: list[tuple[Path, str]]) -> list[dict[str, str]]:
    return [{"path": str(path), "error": why} for path, why in unreadable]


def unreadable_lines(unreadable: list[tuple[Path, str]]) -> list[str]:
    if not unreadable:
        return []
    lines = [f"unreadable  {len(unreadable)} directories (not examined; fix their permissions):"]
    return lines + [f"  {path}: {why}" for path, why in unreadable]


__all__ = [
    "KIND_LABELS",
    "CleanReport",
    "CleanSummary",
    "HeldLock",
    "Leftover",
    "StatusReport",
    "StatusSummary",
    "unreadable_json",
    "unreadable_lines",
]
