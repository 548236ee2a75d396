"""The dataset lockfile: the identity of every shard a job reads, made, written, read, diffed.

A lock is one JSON document (``shardcache.lock``) of a shard list: each shard's size, ETag,
version id (where the bucket keeps versions), the store's checksum and, for local files,
the modification time, and a digest of them all. A job writes it once (the first process
to write wins; the others read the winner's) and every consumer state it takes carries its
digest, so a resume knows which bytes the state counted.

Identities come from what the cache already knows: a cached copy's metadata record holds
the ETag, version and checksum its download was verified against, so a shard in the cache
costs a small file read, no request. Only a shard not in the cache is asked (one ``HEAD``),
and a local file is ``stat``-ed.

What a dataset does with its lock (checked before the first sample, a changed shard read
at its recorded version or named) is :mod:`~shardcache._datasets.lock_check`'s.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from .._base.errors import (
    ConfigError,
    RemoteNotFoundError,
)
from .._base.url_kinds import LOCAL_PROTOCOLS, url_protocol
from .._cache.shard_cache import ShardCache
from .._disk.metadata import read_meta

FORMAT = "shardcache.lock"
VERSION = 1


@dataclass(frozen=True)
class ShardIdentity:
    """What names one shard's bytes: its size, ETag, version id, the store's checksum
    (``<algorithm>:<value>``, ``-<parts>`` for a multipart upload's), a local file's
    modification time. None: not known (the store gives none)."""

    size: int | None
    etag: str | None = None
    version_id: str | None = None
    checksum: str | None = None
    mtime_ns: int | None = None

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> ShardIdentity:
        """From a cache metadata record, a lock entry or an ``ObjectInfo``'s fields."""
        checksum = record.get("checksum")
        if isinstance(checksum, Mapping):
            parts = checksum.get("parts")
            checksum = f"{checksum['algorithm']}:{checksum['value']}" + (
                f"-{parts}" if parts else ""
            )
        return cls(
            _int_or_none(record.get("size")),
            _str_or_none(record.get("etag")),
            _str_or_none(record.get("version_id")),
            _str_or_none(checksum),
            _int_or_none(record.get("mtime_ns")),
        )

    def as_json(self, url: str) -> dict[str, Any]:
        return {
            "url": url,
            "size": self.size,
            "etag": self.etag,
            "version_id": self.version_id,
            "checksum": self.checksum,
            "mtime_ns": self.mtime_ns,
        }

    def differs(self, seen: ShardIdentity) -> list[str]:
        """The fields of the bytes' identity that differ where both sides know them (size,
        ETag, checksum, modification time; not the version: a new version of the same
        bytes is the same shard)."""
        return [
            name
            for name in ("size", "etag", "checksum", "mtime_ns")
            if getattr(self, name) is not None
            and getattr(seen, name) is not None
            and getattr(self, name) != getattr(seen, name)
        ]

    def describe(self, fields: Iterable[str]) -> str:
        """``fields`` with their values, and the version where known."""
        text = ", ".join(f"{name} {getattr(self, name)}" for name in fields)
        return f"{text} (version {self.version_id})" if self.version_id else text


@dataclass(frozen=True)
class Change:
    """One shard that differs from its lock entry (``seen`` None: gone from the store)."""

    url: str
    expected: ShardIdentity
    seen: ShardIdentity | None
    fields: tuple[str, ...]

    def line(self) -> str:
        if self.seen is None:
            return f"{self.url}: gone from the store (locked: {_short(self.expected)})"
        return (
            f"{self.url}: expected {self.expected.describe(self.fields)}, "
            f"seen {self.seen.describe(self.fields)}"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "fields": list(self.fields),
            "expected": self.expected.as_json(self.url),
            "seen": None if self.seen is None else self.seen.as_json(self.url),
        }


@dataclass(frozen=True)
class DatasetLock:
    """The identities of a shard list, in its order."""

    shards: dict[str, ShardIdentity]

    @property
    def digest(self) -> str:
        data = json.dumps([i.as_json(url) for url, i in self.shards.items()], sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:32]

    def document(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "digest": self.digest,
            "shards": [identity.as_json(url) for url, identity in self.shards.items()],
        }

    @classmethod
    def from_document(cls, document: Any, where: str) -> DatasetLock:
        if not isinstance(document, Mapping) or document.get("format") != FORMAT:
            seen = document.get("format") if isinstance(document, Mapping) else None
            raise ConfigError(
                f"{where} is not a shardcache dataset lock (format {seen!r}, expected "
                f"{FORMAT!r}); write one with `shardcache lock SPEC -o {where}`",
                path=where,
                expected=FORMAT,
                seen=seen,
            )
        if document.get("version") != VERSION:
            raise ConfigError(
                f"{where} is a dataset lock of version {document.get('version')!r}; this "
                f"shardcache reads version {VERSION}: write it again with this version",
                path=where,
                expected=VERSION,
                seen=document.get("version"),
            )
        try:
            shards = {
                str(entry["url"]): ShardIdentity.of_record(entry) for entry in document["shards"]
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{where}: a shard entry is damaged ({type(exc).__name__}: {exc}); write the "
                "lock again with shardcache lock",
                path=where,
            ) from None
        lock = cls(shards)
        if document.get("digest") != lock.digest:
            raise ConfigError(
                f"{where}: the lock's digest {document.get('digest')!r} is not that of its "
                f"entries ({lock.digest}): the file was edited or damaged; write it again "
                "with shardcache lock",
                path=where,
                expected=lock.digest,
                seen=document.get("digest"),
            )
        return lock

    def missing(self, urls: Sequence[str]) -> list[str]:
        """The URLs of ``urls`` the lock has no entry for."""
        return [url for url in urls if url not in self.shards]


# -- identities now ------------------------------------------------------------------------


def cached_identity(cache: ShardCache, url: str) -> ShardIdentity | None:
    """The identity of the copy of ``url`` the cache holds, from its metadata record (no
    request); None when not cached or the record is not that copy's."""
    path = cache.path_for(url)
    try:
        st = cache.layout.fs.lstat(path)
    except OSError:
        return None
    record = read_meta(cache.layout, path)
    if not record or record.get("data_ino") != st.st_ino:
        return None
    return ShardIdentity.of_record(record)


def identities(
    urls: Sequence[str],
    cache: ShardCache,
    *,
    threads: int,
    from_cache: bool = True,
    ask: Callable[[str], bool] | None = None,
    held: Mapping[str, ShardIdentity] | None = None,
) -> tuple[dict[str, ShardIdentity | None], int]:
    """Each URL's identity now (None: gone from the store) and how many the store was asked
    for: a cached copy's from its record (unless not ``from_cache``), then ``held``'s (the
    copies other caches of the job hold, as they gave them), a local file's from ``stat``,
    others by one ``HEAD`` each (``threads`` at a time), except those ``ask`` says not to
    ask for (left out of the result)."""
    found: dict[str, ShardIdentity | None] = {}
    asked: list[str] = []
    held = held or {}
    for url in urls:
        local = url_protocol(url) in LOCAL_PROTOCOLS
        known = cached_identity(cache, url) if from_cache and not local else None
        if known is None and not local:
            known = held.get(url)
        if known is not None:
            found[url] = known
        elif local or ask is None or ask(url):
            asked.append(url)

    def stat(url: str) -> ShardIdentity | None:
        try:
            info = cache.remote.info(url)
        except FileNotFoundError:  # RemoteNotFoundError too: gone from the store
            return None
        return ShardIdentity.of_record(
            {
                "size": info.size,
                "etag": info.etag,
                "version_id": info.version_id,
                "checksum": info.checksum.as_record() if info.checksum else None,
                "mtime_ns": info.mtime_ns,
            }
        )

    with cf.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for url, identity in zip(asked, pool.map(stat, asked), strict=True):
            found[url] = identity
    requests = sum(1 for url in asked if url_protocol(url) not in LOCAL_PROTOCOLS)
    return {url: found[url] for url in urls if url in found}, requests


def make_lock(now: Mapping[str, ShardIdentity | None]) -> DatasetLock:
    """The lock of identities found now; a shard gone from the store is an error."""
    gone = [url for url, identity in now.items() if identity is None]
    if gone:
        raise RemoteNotFoundError(
            f"{len(gone)} shards of the list do not exist (first: {gone[0]}); a lock records "
            "existing shards only: fix the shard list",
            url=gone[0],
            attempts=1,
            cause="not found",
        )
    return DatasetLock({url: identity for url, identity in now.items() if identity is not None})


def changes(lock: DatasetLock, now: Mapping[str, ShardIdentity | None]) -> list[Change]:
    """The shards of ``now`` whose identity differs from ``lock``'s, in ``now``'s order."""
    found = []
    for url, seen in now.items():
        expected = lock.shards[url]
        if seen is None:
            found.append(Change(url, expected, None, ()))
        elif fields := expected.differs(seen):
            found.append(Change(url, expected, seen, tuple(fields)))
    return found


# -- the file --------------------------------------------------------------------------------


def read_lock(location: str) -> DatasetLock | None:
    """The lock at ``location`` (a path or fsspec URL); None when there is none."""
    try:
        with fsspec.open(location, "r") as stream:
            document = json.load(stream)
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ConfigError(
            f"the dataset lock {location} is not JSON ({exc}); it is damaged: write it again "
            "with shardcache lock",
            path=location,
        ) from None
    return DatasetLock.from_document(document, location)


def write_lock(location: str, lock: DatasetLock, *, exclusive: bool = False) -> DatasetLock:
    """Write ``lock`` to ``location`` (a local path atomically, or an fsspec URL) and return
    the lock the file holds: with ``exclusive`` a lock already there is kept (the first
    writer wins) and returned instead."""
    data = json.dumps(lock.document(), indent=1)
    if "://" in location and not location.startswith("file://"):
        # No create-if-absent in fsspec: an existing lock is kept, and what the object
        # holds after the write is what every writer uses (equal unless two raced).
        if exclusive and (theirs := read_lock(location)) is not None:
            return theirs
        with fsspec.open(location, "w") as out:
            out.write(data)
        return (read_lock(location) or lock) if exclusive else lock
    path = Path(location.removeprefix("file://"))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(data)
        if not exclusive:
            os.replace(tmp, path)
            return lock
        try:
            os.link(tmp, path)  # fails if another process wrote it first
        except FileExistsError:
            theirs = read_lock(str(path))
            return lock if theirs is None else theirs
        return lock
    except OSError as exc:
        raise ConfigError(
            f"cannot write the dataset lock {location}: {exc.strerror or exc}; give a "
            "writable path",
            path=location,
        ) from None
    finally:
        tmp.unlink(missing_ok=True)


def _short(identity: ShardIdentity) -> str:
    return identity.describe(
        n for n in ("size", "etag", "version_id") if getattr(identity, n) is not None
    )


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_none(value: Any) -> str | None:
    return str(value) if isinstance(value, str) and value else None


__all__ = [
    "Change",
    "DatasetLock",
    "ShardIdentity",
    "changes",
    "identities",
    "make_lock",
    "read_lock",
    "write_lock",
]
