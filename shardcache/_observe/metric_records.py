"""Reading "shardcache.metrics" records, the consumers' side (report, Prometheus, TensorBoard).

The record format is the contract of issue 17 (docs/guides/observability.md): one JSON object per
line, ``schema`` "shardcache.metrics", integer ``version``; counts are deltas over the
record's own period, never cumulative. Readers must be tolerant: unknown keys are ignored,
a missing or malformed count is 0, a missing mapping is empty. A record of a newer
``version`` is refused, since ``version`` changes only when a field changes meaning; a field
added keeps the version (``verified`` came so: older records lack it and count nothing there).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Hashable, Mapping
from typing import Any

SCHEMA = "shardcache.metrics"
VERSION = 1
# The plain counts of a record (deltas of its period), besides its mappings (requests,
# retries, lock_waits), data_wait_s and slowest_shards: the producer makes them, every
# consumer sums them.
COUNTS = (
    "samples",
    "shards",
    "hits",
    "misses",
    "shared",
    "from_peers",
    "bytes_downloaded",
    "bytes_from_peers",
    "bytes_served",
    "peer_fallbacks",
    "peer_corruptions",
    "integrity_redownloads",
    "stall_warnings",
    "stall_errors",
    "delivery_checks",
    "delivery_mismatches",
)
RETRY_CAUSES = ("reset", "5xx", "slowdown", "truncated", "other")
# How a downloaded shard was verified (a record's ``verified``: method -> shards): a checksum
# of the bytes, a multipart upload's checksum over its parts, or the size alone. The sinks
# take labels from this fixed set (any other method is "other").
VERIFIED_METHODS = (
    "crc64nvme",
    "crc32c",
    "crc32",
    "xxhash3",
    "xxhash64",
    "xxhash128",
    "sha1",
    "sha256",
    "sha512",
    "md5",
    "md5-parts",
    "crc32-parts",
    "crc32c-parts",
    "xxhash3-parts",
    "xxhash64-parts",
    "xxhash128-parts",
    "sha1-parts",
    "sha256-parts",
    "sha512-parts",
    "size",
)
# The counts a record also breaks down by mixture source (``sources``: name -> counts),
# present when a MixtureDataset's sources counted in the period.
SOURCE_COUNTS = (
    "samples",
    "hits",
    "misses",
    "shared",
    "from_peers",
    "bytes_downloaded",
    "bytes_served",
)
# How a shard came to its consumer (Prometheus's ``result`` label -> a record's count): found
# cached, downloaded, downloaded by another process, or filled from a peer of the cache mesh.
FETCH_RESULTS = (("hit", "hits"), ("miss", "misses"), ("shared", "shared"), ("peer", "from_peers"))

# What classify() says about one parsed JSON value.
OK, NOT_A_RECORD, NEWER = "ok", "not a shardcache.metrics record", "newer version"


def classify(obj: Any) -> str:
    """``OK``, ``NOT_A_RECORD`` (another schema, no integer version, not an object) or
    ``NEWER`` (a version this shardcache does not know the meaning of)."""
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        return NOT_A_RECORD
    version = obj.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        return NOT_A_RECORD
    return NEWER if version > VERSION else OK


def number(record: Mapping[str, Any], key: str) -> float:
    """A count or duration of ``record``: 0 when missing, null, negative or not a number
    (a delta is never negative; a bad value must not poison a sum)."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    if math.isnan(value) or math.isinf(value) or value < 0:
        return 0.0
    return float(value)


def optional_number(record: Mapping[str, Any], key: str) -> float | None:
    """Like :func:`number`, but None when the record does not carry the field at all."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return number(record, key)


def counts(record: Mapping[str, Any], key: str) -> dict[str, float]:
    """A mapping of counts (``requests``, ``retries``): ``{}`` when missing or malformed."""
    value = record.get(key)
    if not isinstance(value, dict):
        return {}
    return {str(name): number(value, name) for name in value}


def verified_label(method: str) -> str:
    """The label of verification method ``method``: itself if known, else "other"."""
    return method if method in VERIFIED_METHODS else "other"


def sources(record: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """The record's counts per mixture source (tolerant: malformed entries are left out)."""
    value = record.get("sources")
    if not isinstance(value, Mapping):
        return {}
    return {
        str(name): {key: number(part, key) for key in SOURCE_COUNTS}
        for name, part in value.items()
        if isinstance(part, Mapping)
    }


def stream_of(record: Mapping[str, Any]) -> tuple[Hashable, ...]:
    """The process (and DataLoader worker) that wrote ``record``: its records never overlap."""
    return (record.get("job_id"), record.get("host"), record.get("pid"), record.get("worker"))


class PeriodClock:
    """The time each record really covers, per writing process.

    An "epoch" record's ``start`` is the epoch's start while its counts cover only the time
    since the process's previous record: taking ``time - start`` (or its ``period_s``)
    would count that stretch twice in a rate or a share. So a record covers ``time`` minus
    the later of its ``start`` and the previous record's ``time`` of the same process.
    Records must be fed in time order per process (files are, and so are live sinks).
    """

    def __init__(self) -> None:
        self._last: dict[tuple[Hashable, ...], float] = {}

    def covered(self, record: Mapping[str, Any]) -> tuple[float, float]:
        """``(begin, end)`` unix seconds of what ``record`` counts; begin == end when unknown."""
        end = number(record, "time")
        start = optional_number(record, "start")
        if start is None:
            start = end - number(record, "period_s")
        key = stream_of(record)
        previous = self._last.get(key)
        if previous is not None and previous > start:
            start = previous
        self._last[key] = max(end, previous or end)
        return min(start, end), end


def is_main_process(record: Mapping[str, Any]) -> bool:
    """True for the training process itself, False for a DataLoader worker's record."""
    return record.get("worker") is None


class OwnerProcess:
    """Guards a sink that must act only in the process that made it.

    A DataLoader worker forked from the training process inherits its sinks; a Prometheus
    endpoint or a SummaryWriter there would be a copy that nobody reads (or a second writer
    of the same file), so a sink ignores records in any other process.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def here(self) -> bool:
        return os.getpid() == self.pid


__all__ = [
    "COUNTS",
    "NEWER",
    "NOT_A_RECORD",
    "OK",
    "RETRY_CAUSES",
    "SCHEMA",
    "VERIFIED_METHODS",
    "VERSION",
    "OwnerProcess",
    "PeriodClock",
    "classify",
    "counts",
    "is_main_process",
    "number",
    "optional_number",
    "stream_of",
    "verified_label",
]
