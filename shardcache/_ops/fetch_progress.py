"""The progress of work on many shards (``warm``, ``index``, ``verify``): a tqdm bar on a
terminal or a plain line every few seconds, the thread count, and the cache counters'
change."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TextIO

from .._base.units import format_bytes
from .._cache.shard_cache import CacheStats, ShardCache

LOG_EVERY = 5.0  # seconds between plain progress lines when stderr is not a terminal
BAR_REFRESH = 0.5  # seconds between progress-bar refreshes (bytes and rate)


class FetchProgress:
    """Progress on ``stream``: a tqdm bar on a terminal, else a plain line every ``every`` s.

    Counts ``unit``s (of ``total``, None: unknown) and the bytes :meth:`moved` reports, shown
    as ``verb`` (None: no bytes shown)."""

    def __init__(
        self,
        total: int | None,
        stream: TextIO | None,
        every: float,
        *,
        label: str = "warm",
        downloaded: Callable[[], int] | None = None,
        failures: bool = True,
        verb: str | None = "downloaded",
        unit: str = "shard",
    ) -> None:
        self.total = total
        self.stream = stream
        self.every = every
        self.label = label
        self.verb = verb  # what happened to the bytes counted: downloaded, checked
        self.unit = unit
        self._failures = failures  # whether the line counts failed shards (warm goes on)
        self._downloaded = downloaded  # bytes downloaded so far, when not reported by moved()
        self.done = 0
        self.failed = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}  # url -> bytes it reported so far
        self._finished_bytes = 0  # bytes reported by shards that finished
        self._stop = threading.Event()
        self._bar = None
        self._thread: threading.Thread | None = None
        if stream is None:
            return
        if _isatty(stream):
            from tqdm import tqdm

            sized = _columns(stream) > 0  # a pty without a size would get an empty bar
            self._bar = tqdm(
                total=total,
                unit=unit,
                desc=label,
                file=stream,
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                postfix="0 B, 0.0 MB/s" if verb else None,
            )
        self._thread = threading.Thread(target=self._tick, name="shardcache-warm-progress")
        self._thread.daemon = True
        self._thread.start()

    def moved(self, url: str, bytes_done: int) -> None:
        with self._lock:
            self._in_flight[url] = bytes_done

    def finished(self, url: str, ok: bool) -> None:
        with self._lock:
            self._finished_bytes += self._in_flight.pop(url, 0)
            self.done += 1
            self.failed += not ok
            if self._bar is not None:
                self._bar.update(1)

    def line(self) -> str:
        with self._lock:
            done, failed, moved = self.done, self.failed, self._moved()
        elapsed = time.monotonic() - self.started
        rate = moved / 1e6 / elapsed if elapsed > 0 else 0.0
        if self.total is None:
            count, eta = f"{done} {self.unit}s", ""
        else:
            count = f"{done}/{self.total} {self.unit}s"
            if done == self.total:
                eta = ", done"
            else:
                eta = (
                    ", ETA ?" if done == 0 else f", ETA {elapsed / done * (self.total - done):.0f}s"
                )
        failures = f" ({failed} failed)" if self._failures else ""
        moved_text = f", {format_bytes(moved)} {self.verb}, {rate:.1f} MB/s" if self.verb else ""
        return f"{self.label}: {count}{failures}{moved_text}, elapsed {elapsed:.1f}s{eta}"

    def _postfix(self) -> str:
        with self._lock:
            moved = self._moved()
        elapsed = time.monotonic() - self.started
        rate = moved / 1e6 / elapsed if elapsed > 0 else 0.0
        return f"{format_bytes(moved)}, {rate:.1f} MB/s"

    def _moved(self) -> int:
        """Bytes moved into the cache by this run so far (call with ``_lock`` held)."""
        if self._downloaded is not None:
            return self._downloaded()
        return self._finished_bytes + sum(self._in_flight.values())

    def _tick(self) -> None:
        every = BAR_REFRESH if self._bar is not None else self.every
        while not self._stop.wait(every):
            self._show()

    def _show(self) -> None:
        if self._bar is not None:
            if self.verb:
                self._bar.set_postfix_str(self._postfix())
        elif self.stream is not None:
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.stream is not None:
            self._show()  # the final state
        if self._bar is not None:
            self._bar.close()


def thread_count(cache: ShardCache, threads: int | None) -> int:
    threads = cache.settings.threads if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    return threads


def stats_delta(before: CacheStats, after: CacheStats) -> dict[str, int]:
    return {
        "hits": after.hits - before.hits,
        "misses": after.misses - before.misses,
        "shared": after.shared - before.shared,
        "bytes_served": after.bytes_served - before.bytes_served,
        "bytes_downloaded": after.bytes_downloaded - before.bytes_downloaded,
    }


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0
