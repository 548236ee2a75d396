"""The delivery digest as documented (shardcache._datasets.delivery_digest), one sample at a
time with Python integers: the tests' independent reference."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

MASK = (1 << 64) - 1


def sample_hash(epoch: int, source: str | None, url: str, index: int) -> int:
    name = f"{epoch}\x1f{source or ''}\x1f{url}".encode()
    key = int.from_bytes(
        hashlib.blake2b(name, digest_size=8, person=b"shardcache-dlv1").digest(), "little"
    )
    x = (key + index * 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def tally(epoch: int, source: str | None, samples: Iterable[tuple[str, int]]) -> list:
    """``[hex digest, count]`` (a state's JSON form) of ``(url, index)`` samples."""
    total, count = 0, 0
    for url, index in samples:
        total += sample_hash(epoch, source, url, index)
        count += 1
    return [f"{total & MASK:016x}", count]
