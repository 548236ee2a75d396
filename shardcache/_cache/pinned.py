"""Fetched shards kept pinned (a shared ``flock``: not evictable): a fetch followed by a pin,
fetched again if the file went between the two, and the table of pins the cache holds for
the prefetcher until it releases each shard after its consumer is done with it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from .._base.errors import CacheFullError
from .._disk.layout import CacheLayout
from .._store.growing import Announce, GrowingFile
from .._store.pins import open_pinned, pin, reopen_pinned
from .._store.publish import VANISHED_RETRIES

if TYPE_CHECKING:
    from .._config.settings import Settings
    from .._prefetch.workers import WorkerProgress
    from .._transfer.download import Progress

CacheFetch = Callable[[str, "Progress | None", "Announce | None"], Path]
"""A cache's fetch of a URL; the announce callback gets a download this process makes."""


class PinTable:
    """The pins the cache holds for shards the prefetcher handed over (several per path)."""

    def __init__(self, layout: CacheLayout) -> None:
        self._layout = layout
        self._pins: dict[Path, list[int]] = {}  # prefetched shards not yet released
        self._lock = threading.Lock()

    def hold(self, path: Path, fd: int) -> None:
        """Keep the pin ``fd`` on ``path`` until :meth:`release`."""
        with self._lock:
            self._pins.setdefault(path, []).append(fd)

    def release(self, path: Path) -> None:
        """Let go of one pin on ``path`` (the prefetcher's consumer is done with it)."""
        with self._lock:
            fds = self._pins.get(path)
            fd = fds.pop() if fds else None
            if fds == []:
                del self._pins[path]
        if fd is not None:
            os.close(fd)

    def open(self, path: Path) -> BinaryIO:
        """Open ``path`` for reading, pinned until closed: through a pin held here (so it
        opens even if its file was removed meanwhile), else by its name."""
        with self._lock:
            fds = self._pins.get(path)
            pin_fd = fds[-1] if fds else None
        if pin_fd is None:
            return open_pinned(self._layout, path)
        return reopen_pinned(pin_fd)


class PinnedFetch:
    """A cache's ``fetch`` followed by a pin on the result; for the prefetcher, pins held in
    ``pins``. The fetch is passed to each call (the cache holds this, not the reverse)."""

    def __init__(self, layout: CacheLayout, settings: Settings, pins: PinTable) -> None:
        self._layout = layout
        self._settings = settings
        self._pins = pins

    def fetch_and_pin(
        self,
        fetch: CacheFetch,
        url: str,
        progress: Progress | None,
        announce: Announce | None = None,
    ) -> tuple[Path, int | None]:
        """``fetch``, then a pin (shared flock) on the result; fetched again if the file
        went (evicted, or removed) between the two. With ``announce``: a download this
        process made is pinned since its ``.part`` was created (no gap at all), and a
        download a reader claimed early is pinned by that reader (the pin is then None)."""
        offered: list[GrowingFile] = []

        def offer(growing: GrowingFile) -> None:
            offered.append(growing)
            if announce is not None:
                announce(growing)

        for _ in range(VANISHED_RETRIES):
            offered.clear()
            path = fetch(url, progress, None if announce is None else offer)
            fd = offered[-1].detach_pin() if offered else None
            if any(growing.claimed for growing in offered):
                if fd is not None:
                    os.close(fd)
                return path, None
            if fd is None:
                fd = pin(self._layout, path)
            if fd is not None:
                return path, fd
        raise CacheFullError(
            f"{url} was evicted or removed {VANISHED_RETRIES} times right after being fetched. "
            f"Either SHARDCACHE_MAX_BYTES={self._settings.max_bytes} cannot hold the shards in "
            "use plus the prefetch depth (raise it, or lower SHARDCACHE_PREFETCH_DEPTH), or "
            f"something keeps deleting files in {self._settings.scope_dir}.",
            url=url,
            path=str(path),
            max_bytes=self._settings.max_bytes,
        )

    def fetch_pinned(self, fetch: CacheFetch, url: str, progress: Progress) -> Path:
        """``fetch`` for the prefetcher: the shard stays pinned (not evictable) until the
        prefetcher releases it, after its consumer is done with it."""
        path, fd = self.fetch_and_pin(fetch, url, progress)
        assert fd is not None
        self._pins.hold(path, fd)
        return path

    def fetch_streaming(self, fetch: CacheFetch, url: str, progress: WorkerProgress) -> Path:
        """:meth:`fetch_pinned` whose download is offered to the consumer as soon as its first
        bytes landed (``progress.offer``: :meth:`Prefetcher.next_early`). A shard the
        consumer claimed early is pinned by its reader, not held for the prefetcher."""
        path, fd = self.fetch_and_pin(fetch, url, progress, progress.offer)
        if fd is not None:
            self._pins.hold(path, fd)
        return path
