"""``verify``: check every cached shard's content against its source and remove bad ones.

The source is, per shard, a manifest entry's ``size``/``md5``/``sha256`` when one is given,
else the remote object (size and the checksum a download would be checked against now:
its full-object checksum, the ETag's MD5 where the store promises one, a multipart
upload's checksum over the parts recorded at download; else the ETag recorded then).
A shard is removed only through ``ShardCache.remove`` (never while a reader holds it), and
nothing is ever run: a ``pipe:`` command's copy is checked against a manifest or the size
recorded when the command ran, never by running the command again.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .._base.errors import ShardCacheError
from .._base.redact import get_logger
from .._base.safefs import SafeFS
from .._base.url_kinds import is_pipe_url
from .._cache.shard_cache import ShardCache
from .._datasets.urls import read_manifest
from .._disk.metadata import read_meta
from .._store.eviction import CacheEntry, scan
from .._store.publish import SIZE_ONLY
from .._transfer.checksums import Checksum, Hasher
from .._transfer.download import ObjectInfo
from .._transfer.multipart import PartLayout, PartsHasher
from .fetch_progress import LOG_EVERY, FetchProgress
from .maintenance import require_scope_dir
from .maintenance_reports import (
    SIZE_NOTE,
    method_counts,
    unreadable_json,
    unreadable_lines,
    verified_text,
)

logger = get_logger(__name__)

_HASH_CHUNK = 8 << 20
_CHECKED = ("ok", "bad")  # the outcomes of a shard that was checked


@dataclass(frozen=True)
class VerifyItem:
    """The outcome for one cached shard."""

    path: Path
    url: str | None
    outcome: str  # "ok" | "bad" | "unknown-origin" | "skipped" | "error"
    detail: str = ""
    removed: bool = False
    method: str | None = None  # what it was checked by ("crc32", "md5-parts", "size", ...)

    def as_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "url": self.url,
            "outcome": self.outcome,
            "detail": self.detail,
            "removed": self.removed,
            "method": self.method,
        }


@dataclass
class VerifyReport:
    """What ``verify`` found; ``failed`` when any shard was bad or could not be checked."""

    scope_dir: Path
    items: list[VerifyItem] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # (directory, why)

    def of(self, outcome: str) -> list[VerifyItem]:
        return [i for i in self.items if i.outcome == outcome]

    @property
    def failed(self) -> bool:
        return bool(self.of("bad") or self.of("error") or self.unreadable)

    @property
    def verified(self) -> dict[str, int]:
        """The checked shards (ok or bad) by what they were checked by, most first."""
        return method_counts(i.method or SIZE_ONLY for i in self.items if i.outcome in _CHECKED)

    def as_json(self) -> dict[str, Any]:
        counts = {o: len(self.of(o)) for o in ("ok", "bad", "unknown-origin", "skipped", "error")}
        return {
            "scope_dir": str(self.scope_dir),
            "counts": counts,
            "verified": self.verified,
            "items": [i.as_json() for i in self.items if i.outcome != "ok"],
            "unreadable": unreadable_json(self.unreadable),
        }

    def format(self) -> str:
        bad, errors = self.of("bad"), self.of("error")
        unknown, skipped = self.of("unknown-origin"), self.of("skipped")
        lines = [
            f"verify {self.scope_dir}: {len(self.items)} shards, {len(self.of('ok'))} ok, "
            f"{len(bad)} bad, {len(errors)} not checkable, {len(unknown)} of unknown origin, "
            f"{len(skipped)} skipped"
        ]
        if self.verified:
            lines.append(f"  checked by: {verified_text(self.verified)}")
            if self.verified.get(SIZE_ONLY):
                lines.append(f"  {SIZE_NOTE}")
        for item in bad:
            action = "removed" if item.removed else "NOT removed (in use; run again later)"
            lines.append(f"  bad: {item.url}: {item.detail}; {action}")
        lines += [f"  error: {i.url}: {i.detail}" for i in errors]
        lines += [f"  unknown origin (no metadata record): {i.path}" for i in unknown]
        lines += [f"  skipped: {i.url}: {i.detail}" for i in skipped]
        lines += unreadable_lines(self.unreadable)
        return "\n".join(lines)


def verify(
    cache: ShardCache,
    manifest: str | os.PathLike[str] | None = None,
    *,
    threads: int | None = None,
    quick: bool = False,
    stream: TextIO | None = None,
) -> VerifyReport:
    """Check every cached shard against its remote object (size, MD5 of single-part
    objects, ETag recorded at download) or, for URLs a manifest lists with ``size`` /
    ``md5`` / ``sha256``, against the manifest; remove bad ones with ``cache.remove``.

    A ``pipe:`` command is never run again to verify its output (it may be slow, costly or
    not repeatable): without a manifest entry its copy is only checked against the size
    recorded when the command ran, and reported as skipped when that matches.

    ``quick``: only each shard's size against the size recorded in its metadata record
    when it was cached (a truncated or replaced file); no source is asked, nothing is
    hashed, the manifest is not used. Seconds for 100,000 shards.

    Progress goes to ``stream`` as :func:`shardcache.warm.warm` shows it (None: none)."""
    expected: dict[Path, dict[str, Any]] = {}  # by cached path: recorded URLs may be redacted
    if manifest is not None:
        # Checksums only: nothing in a manifest is run here, so pipe: entries are data.
        for entry in read_manifest(manifest, allow_pipes=True):
            if {"size", "md5", "sha256"} & entry.meta.keys():
                expected[cache.path_for(entry.url)] = entry.meta
    require_scope_dir(cache.settings)
    report = VerifyReport(scope_dir=cache.layout.scope_dir)
    entries = scan(cache.layout, with_meta=True, unreadable=report.unreadable)[0]
    # --quick reads no byte: its progress counts shards, not bytes checked a second.
    verb = None if quick else "checked"
    progress = FetchProgress(len(entries), stream, LOG_EVERY, label="verify", verb=verb)

    def check(entry: CacheEntry) -> VerifyItem:
        item = _verify_quick(cache, entry) if quick else _verify_one(cache, entry, expected)
        progress.moved(str(entry.path), entry.size)
        progress.finished(str(entry.path), ok=item.outcome not in ("bad", "error"))
        return item

    threads = 1 if quick else cache.settings.threads if threads is None else threads
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="shardcache-verify") as pool:
            report.items = list(pool.map(check, entries))
    finally:
        progress.close()
    return report


def _verify_one(cache: ShardCache, entry: Any, expected: dict[Path, dict[str, Any]]) -> VerifyItem:
    path, url = Path(entry.path), entry.url
    if url is None:
        return VerifyItem(path, None, "unknown-origin", "no metadata record")
    want = expected.get(path)
    if entry.url_redacted and want is None:
        return VerifyItem(
            path,
            url,
            "skipped",
            "its URL carries credentials (a password or a presigned signature), which "
            "shardcache does not record; list it with size/md5/sha256 in a manifest to check it",
        )
    if not entry.url_redacted and cache.path_for(url) != path:
        return VerifyItem(
            path, url, "skipped", "cached from another endpoint than the current configuration"
        )
    try:
        if is_pipe_url(url) and want is None:
            problem, method = _check_recorded_size(cache, entry), SIZE_ONLY
            if problem is None:
                return VerifyItem(
                    path,
                    url,
                    "skipped",
                    "a pipe: command is not run again to verify it; the size matches the "
                    f"{entry.size} bytes recorded when it ran (list it with size/md5/sha256 "
                    "in a manifest to check its content)",
                )
        else:
            problem, method = _check(cache, entry, want)
    except FileNotFoundError:
        return VerifyItem(path, url, "skipped", "removed from the cache meanwhile")
    except (ShardCacheError, OSError) as exc:
        return VerifyItem(path, url, "error", f"{type(exc).__name__}: {' '.join(str(exc).split())}")
    if problem is None:
        return VerifyItem(path, url, "ok", method=method)
    removed = cache.remove(path)
    logger.info("bad cached shard %s (%s): %s", url, path, problem)
    return VerifyItem(path, url, "bad", problem, removed, method)


def _verify_quick(cache: ShardCache, entry: Any) -> VerifyItem:
    """``entry``'s size against its record's (read by the scan, with the size it saw)."""
    path, url = Path(entry.path), entry.url
    if url is None:
        return VerifyItem(path, None, "unknown-origin", "no metadata record")
    if entry.recorded_size is None:
        return VerifyItem(path, url, "skipped", "no size was recorded when it was cached")
    if entry.recorded_size == entry.size:
        return VerifyItem(path, url, "ok", method=SIZE_ONLY)
    problem = f"size {entry.size} bytes, {entry.recorded_size} recorded when it was cached"
    removed = cache.remove(path)
    logger.info("bad cached shard %s (%s): %s", url, path, problem)
    return VerifyItem(path, url, "bad", problem, removed, SIZE_ONLY)


def _check(cache: ShardCache, entry: Any, meta: dict[str, Any] | None) -> tuple[str | None, str]:
    """What is wrong with the cached copy (None: nothing), and what it is checked by (the
    checksums' names, ``md5+sha256`` for a manifest's two; ``size`` for the size alone)."""
    size = cache.layout.fs.lstat(entry.path).st_size
    if meta is not None:
        source = "the manifest"
        want_size = meta.get("size")
        want = {k: str(meta[k]).lower() for k in ("md5", "sha256") if meta.get(k)}
        hashers = {name: _HexHasher(name) for name in want}
    else:
        source = "the remote object"
        info = cache.remote.info(entry.url)
        want_size = info.size
        # What a download of it would be checked against now (the store's cheapest
        # checksum: never the ETag where the store does not promise it is an MD5).
        checksum = info.expected_checksum("etag")
        hasher = _hasher(cache, entry.path, info, checksum) if checksum is not None else None
        want = {checksum.method: checksum.value} if checksum and hasher else {}
        hashers = {checksum.method: hasher} if checksum and hasher else {}
        if not want and entry.etag and info.etag and entry.etag != info.etag:
            return (
                f"the remote object changed since it was cached (ETag {info.etag}, "
                f"cached copy {entry.etag})"
            ), SIZE_ONLY
    method = "+".join(sorted(want)) or SIZE_ONLY
    if want_size is not None and int(want_size) != size:
        return f"size {size} bytes, {source} has {want_size}", method
    if want:
        got = _hashes(cache.layout.fs, entry.path, hashers)
        for name, value in want.items():
            if got[name] != value:
                return f"{name} {got[name]}, {source} has {value}", method
    return None, method


def _hasher(
    cache: ShardCache, path: Path, info: ObjectInfo, checksum: Checksum
) -> Hasher | PartsHasher | None:
    """A running ``checksum`` of the cached copy: for a multipart upload's, over the parts
    recorded when it was cached (else every part's size asked of the store: a wrong guess
    would remove a good copy); None when the store describes no parts."""
    if checksum.parts is None:
        return Hasher(checksum.algorithm)
    layout = PartLayout.from_record(read_meta(cache.layout, path).get("parts"))
    if layout is None or len(layout.sizes) != checksum.parts or layout.total != info.size:
        layout = cache.remote.part_layout(info, checksum.parts, exact=True)
    return PartsHasher(checksum.algorithm, layout) if layout is not None else None


def _check_recorded_size(cache: ShardCache, entry: Any) -> str | None:
    """What is wrong with a cached copy's size against its metadata record, or None."""
    size = cache.layout.fs.lstat(entry.path).st_size
    recorded = read_meta(cache.layout, entry.path).get("size")
    if recorded is None:
        return "no size was recorded when the command ran"
    if int(recorded) != size:
        return f"size {size} bytes, {recorded} recorded when the command ran"
    return None


class _HexHasher:
    """A manifest's ``md5`` / ``sha256``: hashlib, in hex."""

    def __init__(self, name: str) -> None:
        self._hash = hashlib.new(name)

    def update(self, data: Any) -> None:
        self._hash.update(data)

    def value(self) -> str:
        return self._hash.hexdigest()


def _hashes(fs: SafeFS, path: Path, hashers: dict[str, Any]) -> dict[str, str]:
    with os.fdopen(fs.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            for h in hashers.values():
                h.update(chunk)
    return {name: h.value() for name, h in hashers.items()}


__all__ = ["VerifyItem", "VerifyReport", "verify"]
