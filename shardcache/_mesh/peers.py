"""Which peers a process asks: a peer that failed is put aside, 30 s after its first failure
and twice as long after each further one up to 5 minutes, so a dead node costs one bounded
attempt, not one per shard; a success takes it back at once.

One table per process (:func:`health`). A forked DataLoader worker starts from its parent's
verdicts, with a lock of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._base.process_local import ProcessLocal

logger = logging.getLogger("shardcache.mesh")

FIRST_PAUSE = 30.0  # seconds a peer is put aside after its first failure
LONGEST_PAUSE = 300.0


@dataclass
class _Verdict:
    failures: int
    until: float


class PeerHealth:
    """The peers put aside in this process, by their address (``host:port``)."""

    def __init__(
        self,
        *,
        first: float = FIRST_PAUSE,
        longest: float = LONGEST_PAUSE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._first, self._longest, self._clock = first, longest, clock
        self._aside: dict[str, _Verdict] = {}
        self._lock = threading.Lock()

    def usable(self, peer: str) -> bool:
        """Whether ``peer`` may be asked now."""
        with self._lock:
            verdict = self._aside.get(peer)
            return verdict is None or self._clock() >= verdict.until

    def failed(self, peer: str, why: str) -> float:
        """Put ``peer`` aside after a failure (``why``, for the log); the seconds it is put
        aside for."""
        with self._lock:
            before = self._aside.get(peer)
            failures = 1 if before is None else before.failures + 1
            pause = min(self._first * 2 ** (failures - 1), self._longest)
            self._aside[peer] = _Verdict(failures, self._clock() + pause)
        logger.warning(
            "cache mesh: peer %s failed (%s); asking the store instead for %.0f s", peer, why, pause
        )
        return pause

    def succeeded(self, peer: str) -> None:
        """``peer`` answered: ask it again from now on."""
        with self._lock:
            self._aside.pop(peer, None)

    def forked(self) -> PeerHealth:
        """This table for a forked child: the same verdicts, a new lock."""
        child = PeerHealth(first=self._first, longest=self._longest, clock=self._clock)
        child._aside = {peer: _Verdict(v.failures, v.until) for peer, v in self._aside.items()}
        return child


_process: ProcessLocal[PeerHealth] = ProcessLocal(PeerHealth, after_fork=PeerHealth.forked)


def health() -> PeerHealth:
    """This process's table of peers put aside."""
    return _process.get()
