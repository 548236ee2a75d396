"""``shardcache index`` as a function: every shard fetched through the cache and its
sample offsets learned (:func:`shardcache._datasets.sample_index.learn`), with warm's progress."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from .._base.redact import redact_text
from .._base.units import format_bytes
from .._cache.shard_cache import ShardCache
from .fetch_progress import LOG_EVERY, FetchProgress, thread_count

if TYPE_CHECKING:
    from .._datasets.sample_index import SampleIndex


@dataclass
class IndexResult:
    """What one :func:`build_index` run found: every shard's samples (in ``urls`` order)
    and the cache activity of this run."""

    scope_dir: Path
    urls: list[str]
    index: SampleIndex
    misses: int = 0  # shards this run downloaded
    shared: int = 0  # shards another process downloaded while this run waited
    bytes_downloaded: int = 0
    seconds: float = 0.0

    @property
    def cached(self) -> int:
        """Shards that were in the cache already."""
        return max(0, len(set(self.urls)) - self.misses - self.shared)

    @property
    def samples(self) -> int:
        return sum(self.index[url].count for url in self.urls)

    @property
    def bytes_indexed(self) -> int:
        return sum(self.index[url].size for url in self.urls)

    @property
    def empty(self) -> list[str]:
        """Shards that hold no sample (left out of every epoch)."""
        return [url for url in self.urls if self.index[url].count == 0]

    def summary(self, target: str) -> str:
        """A summary line, then a warning about shards without samples, if any."""
        lines = [
            f"index: {len(self.urls)} shards, {self.samples} samples, "
            f"{format_bytes(self.bytes_indexed)} indexed in {self.seconds:.1f} s (cached "
            f"{self.cached}, misses {self.misses}, shared {self.shared}; "
            f"{format_bytes(self.bytes_downloaded)} downloaded); written to "
            f"{redact_text(target)}"
        ]
        empty = self.empty
        if empty:
            lines.append(
                f"warning: {len(empty)} of {len(self.urls)} shards hold no sample (no member "
                "named key.suffix) and are left out of every epoch:"
            )
            lines += [redact_text(f"  {url}") for url in empty[:_EMPTY_LISTED]]
            if len(empty) > _EMPTY_LISTED:
                lines.append(f"  ... and {len(empty) - _EMPTY_LISTED} more (--json lists all)")
        return "\n".join(lines)

    def as_json(self, target: str) -> dict[str, object]:
        return {
            "index": redact_text(target),
            "shards": len(self.urls),
            "samples": self.samples,
            "bytes_indexed": self.bytes_indexed,
            "seconds": round(self.seconds, 3),
            "cached": self.cached,
            "misses": self.misses,
            "shared": self.shared,
            "bytes_downloaded": self.bytes_downloaded,
            "cache": str(self.scope_dir),
            "empty_shards": [redact_text(url) for url in self.empty],
            "warnings": [f"{len(self.empty)} of {len(self.urls)} shards hold no sample"]
            if self.empty
            else [],
        }


_EMPTY_LISTED = 20  # shards without samples named by the summary (all with --json)


def build_index(
    cache: ShardCache,
    urls: Sequence[str],
    *,
    threads: int | None = None,
    stream: TextIO | None = None,
    log_every: float = LOG_EVERY,
) -> IndexResult:
    """Fetch every URL through ``cache`` (``threads`` at a time) and learn its samples
    (:func:`shardcache._datasets.sample_index.learn`); progress on ``stream`` as :func:`warm` shows
    it. The first shard that fails stops the run: its error is raised."""
    from .._datasets.sample_index import learn

    threads = thread_count(cache, threads)
    urls = list(urls)
    before = cache.stats()
    started = time.monotonic()
    progress = FetchProgress(
        len(urls),
        stream,
        log_every,
        label="index",
        downloaded=lambda: cache.stats().bytes_downloaded - before.bytes_downloaded,
        failures=False,
    )
    try:
        index = learn(
            urls,
            cache,
            threads=threads,
            on_done=lambda url: progress.finished(url, ok=True),
        )
    finally:
        progress.close()
    after = cache.stats()
    return IndexResult(
        scope_dir=cache.settings.scope_dir,
        urls=urls,
        index=index,
        misses=after.misses - before.misses,
        shared=after.shared - before.shared,
        bytes_downloaded=after.bytes_downloaded - before.bytes_downloaded,
        seconds=time.monotonic() - started,
    )
