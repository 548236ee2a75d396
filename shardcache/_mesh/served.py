"""What a node's mesh server may hand out: from a request's shard identity (scope directory,
protocol, store namespace, canonical URL) to an open, published copy, or the reason not.

The path is computed from the identity exactly as a local fetch computes it
(:meth:`CacheLayout.identify`); a request never names a path, and a download in progress has
a temp name no identity maps to. A copy is served only when it is a regular file this cache
trusts, reached without following a link, whose metadata record describes this very copy
(same inode and size), of a shard the job's dataset holds, from a remote store (a local
file's freshness is for its own node to judge, and a ``pipe:`` command's output is not a
stored object).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._base.url_kinds import LOCAL_PROTOCOLS, is_pipe_url
from .._disk.layout import CacheLayout
from .._disk.metadata import read_meta

# The record fields a receiver checks the bytes and the copy's identity against.
RECORD_FIELDS = (
    "size",
    "checksum",
    "etag",
    "version_id",
    "verified",
    "mtime_ns",
    "parts",
    "mesh_crc32c",
)


class NotServed(Exception):
    """A request the server answers without bytes: ``status`` and ``reason`` (for the log and
    the answer's text)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class Served:
    """An open published copy: its descriptor (the caller closes it), size and record."""

    fd: int
    size: int
    record: dict[str, Any]

    def record_header(self) -> str:
        """The record as the ``X-Shardcache-Record`` header carries it (ASCII JSON)."""
        return json.dumps(
            {key: self.record.get(key) for key in RECORD_FIELDS}, sort_keys=True, ensure_ascii=True
        )


@dataclass(frozen=True)
class ShardRequest:
    """Which shard a request asks for, as the query gives it."""

    scope: str
    protocol: str
    namespace: str
    url: str

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> ShardRequest:
        try:
            made = cls(query["scope"], query["proto"], query["ns"], query["url"])
        except KeyError as missing:
            raise NotServed(400, f"the query has no {missing.args[0]!r}") from None
        if not all((made.scope, made.protocol, made.url)):
            raise NotServed(400, "scope, proto and url must not be empty")
        return made

    def query(self) -> dict[str, str]:
        return {"scope": self.scope, "proto": self.protocol, "ns": self.namespace, "url": self.url}


class ServedShards:
    """The published shards of ``layouts`` (scope directory name -> its layout) that the job
    may read: those ``allowed(canonical_url, namespace)`` accepts."""

    def __init__(
        self, layouts: Mapping[str, CacheLayout], allowed: Callable[[str, str], bool]
    ) -> None:
        self._layouts = layouts  # may make a layout when first asked
        self._allowed = allowed

    def open(self, request: ShardRequest) -> Served:
        """``request``'s published copy, open for reading; :class:`NotServed` otherwise."""
        layout = self._layouts.get(request.scope)
        if layout is None:
            raise NotServed(404, f"no scope {request.scope!r} is served here")
        if request.protocol in LOCAL_PROTOCOLS or is_pipe_url(request.url):
            raise NotServed(404, "only shards of a remote store are served")
        shard = layout.identify(request.url, request.protocol, request.namespace)
        if shard.canonical_url != request.url or not self._allowed(request.url, request.namespace):
            raise NotServed(404, "not a shard of this job's dataset")
        try:
            fd = layout.fs.open(
                shard.data_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except OSError:
            raise NotServed(404, "no published copy here") from None
        try:
            return self._check(layout, shard.data_path, fd)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _check(layout: CacheLayout, path: Any, fd: int) -> Served:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not layout.trust.trusts_file(st):
            raise NotServed(404, "the copy here is not one this cache trusts")
        record = read_meta(layout, path)
        if record.get("data_ino") != st.st_ino or record.get("size") != st.st_size:
            raise NotServed(404, "the copy here has no record of its own")
        return Served(fd, st.st_size, record)
