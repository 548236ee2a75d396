"""A thread-safe token bucket: the cache mesh's upload cap, and the link shaping of
:class:`~shardcache.testing.FaultProxy` (per connection and in total) and its request-rate
limit."""

from __future__ import annotations

import threading
import time


class TokenBucket:
    """A thread-safe token bucket: :meth:`take` blocks until ``n`` bytes may pass.

    Callers reserve tokens (the balance may go negative) and then sleep off the debt, so
    concurrent takers share the rate fairly in arrival order. ``burst`` is the most that
    can pass at once after an idle period.
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(self.rate * 0.01, 64 * 1024)
        self._tokens = self.burst
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Take ``n`` tokens now; returns how long the caller must wait before sending."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            return -self._tokens / self.rate if self._tokens < 0 else 0.0

    def try_take(self, n: int = 1) -> bool:
        """Take ``n`` tokens if the bucket holds them now; never blocks or goes negative."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            if self._tokens < n:
                return False
            self._tokens -= n
            return True

    def take(self, n: int) -> None:
        """Block until ``n`` tokens are available."""
        wait = self.reserve(n)
        if wait > 0:
            time.sleep(wait)
