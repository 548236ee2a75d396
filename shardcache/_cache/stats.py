"""A cache's counters: :class:`CacheStats` and the thread-safe counter that also reports
the loader metrics among them (:mod:`shardcache._observe.metrics`)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .._observe import metrics
from .._observe.metric_records import COUNTS


@dataclass
class CacheStats:
    """Counters of this process's cache activity; ``verified``: the shards this process
    downloaded by how each was verified (``{"crc32": 12, "size": 4}``: see
    docs/guides/observability.md, "How shards were verified")."""

    hits: int = 0  # found complete in the cache
    misses: int = 0  # downloaded by this process
    shared: int = 0  # downloaded by another process while we waited for the lock
    from_peers: int = 0  # filled from a peer of the cache mesh by this process
    bytes_downloaded: int = 0  # from the store
    bytes_from_peers: int = 0
    bytes_served: int = 0  # bytes of shards returned (hits, misses, shared and from peers)
    peer_fallbacks: int = 0  # a peer failed (gave nothing usable): the next one, or the store
    peer_corruptions: int = 0  # of those, a peer's copy whose bytes failed their checksum
    download_seconds: float = 0.0
    lock_wait_seconds: float = 0.0
    errors: int = 0
    # the shards this process downloaded, by how each was verified: "crc64nvme", "md5",
    # "md5-parts", ... (a checksum of the store's), "size" (nothing more than the size)
    verified: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# CacheStats counters that are also loader metrics (shardcache._observe.metrics); lock waits are
# counted by the lock itself, which knows whom it waited for.
_METRICS_COUNTS = frozenset(COUNTS) & {f.name for f in fields(CacheStats)}


class StatsCounter:
    """One cache's :class:`CacheStats`, added to from any thread."""

    def __init__(self) -> None:
        self._stats = CacheStats()
        self._lock = threading.Lock()

    def count(self, url: str, verified: str | None = None, **deltas: float) -> None:
        """Add ``deltas`` (about shard ``url``) to the cache's stats and the metrics;
        ``verified``: ``url`` was downloaded and published, verified by this method."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)
            if verified is not None:
                methods = self._stats.verified
                methods[verified] = methods.get(verified, 0) + 1
        shown = {k: v for k, v in deltas.items() if k in _METRICS_COUNTS}
        if shown:
            metrics.count(url, **shown)
        if verified is not None:
            metrics.verified(verified)

    def snapshot(self) -> CacheStats:
        """A copy of the counters as they are now."""
        with self._lock:
            return CacheStats(**self._stats.as_dict())
