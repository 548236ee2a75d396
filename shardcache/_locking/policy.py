"""How long and how to wait for a shard lock: the lock mode, the hard timeout, when a holder
counts as stuck, when a silent lease is broken, and the poll backoff each mode uses."""

from __future__ import annotations

from dataclasses import dataclass

from .._config.settings import SPECS


@dataclass(frozen=True, kw_only=True)
class LockPolicy:
    """How long and how to wait for a shard lock."""

    mode: str = "flock"  # "flock" or "lease"
    # Defaults from the settings' specs (one place): SHARDCACHE_LOCK_TIMEOUT (hard limit on
    # the wait), _LOCK_STUCK_AFTER (give up on a holder whose progress record did not
    # change), _LEASE_TIME (break a lease whose record did not change).
    timeout: float = SPECS["lock_timeout"].default
    stuck_after: float = SPECS["lock_stuck_after"].default
    lease_time: float = SPECS["lease_time"].default

    @property
    def backoff(self) -> tuple[float, float]:
        """(first, max) poll delay: short on local disks, gentler on shared ones."""
        if self.mode == "lease":
            return 0.05, max(0.05, min(10.0, self.lease_time / 4))
        return 0.01, 1.0


__all__ = ["LockPolicy"]
