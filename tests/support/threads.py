"""The prefetch threads a test started, and the check that every one of them ended."""

from __future__ import annotations

import threading
import time

from shardcache._prefetch.prefetcher import THREAD_NAME_PREFIX


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


class PrefetchThreads:
    """The prefetch threads alive when this was made, to tell the ones started since.

    Only those are checked: a thread an earlier test in the same process (an xdist worker)
    left behind is that test's finding, not this one's.
    """

    def __init__(self) -> None:
        self._before = set(_prefetch_threads())

    def started(self) -> list[threading.Thread]:
        """The prefetch threads started since, still in ``threading.enumerate()``."""
        return [t for t in _prefetch_threads() if t not in self._before]

    def assert_ended(self, timeout: float = 10.0) -> None:
        """Every prefetch thread started since has ended, waiting up to ``timeout`` in all."""
        deadline = time.monotonic() + timeout
        for thread in self.started():
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self.started() if t.is_alive()]
        assert not alive, f"prefetch threads still running after {timeout}s: {alive}"
