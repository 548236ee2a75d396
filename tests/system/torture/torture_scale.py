"""The torture suite's one knob, ``SHARDCACHE_TORTURE=full`` (set by ``scripts/torture``).

A module of its own, not ``conftest``: the tests' spawned children import the test modules,
and for them ``conftest`` may resolve to tests/conftest.py, depending on the order pytest
collected the directories.
"""

from __future__ import annotations

import os

FULL = os.environ.get("SHARDCACHE_TORTURE", "").lower() == "full"


def scale(ci: int, full: int) -> int:
    """``full`` under SHARDCACHE_TORTURE=full, else ``ci``."""
    return full if FULL else ci
