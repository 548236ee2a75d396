"""The pieces of a consumer's plan, the seeded shard order and the shuffle buffer's draws.

A *consumer* is one DataLoader worker of one rank (slot ``rank * workers + worker``); its
*plan* is an ordered list of :class:`Piece` s (who gets which:
:mod:`shardcache._datasets.epoch_split`).

Everything here is a pure function of its arguments and portable: the order comes from
BLAKE2 digests, not from an RNG whose stream could change between Python versions, so
every rank (and every restart) computes the same plan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """``count`` samples of shard ``shard`` from the one starting at byte ``start`` (None:
    to the end of the shard)."""

    shard: int
    start: int = 0
    count: int | None = None

    def as_json(self) -> list[int | None]:
        return [self.shard, self.start, self.count]

    @classmethod
    def from_json(cls, value: Sequence[int | None]) -> Piece:
        count = value[2] if len(value) > 2 else None
        return cls(int(value[0] or 0), int(value[1] or 0), None if count is None else int(count))


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=16).digest()


def epoch_order(count: int, seed: int, epoch: int, *, shuffle: bool = True) -> list[int]:
    """The shard indices of ``epoch`` in reading order: a permutation drawn from
    ``(seed, epoch)``, or ``0..count-1`` when not shuffling."""
    if not shuffle:
        return list(range(count))
    return sorted(range(count), key=lambda index: _digest(seed, epoch, index))


class RandomDraws:
    """Indices below ``n`` drawn from ``key`` and a counter: the draw ``k`` is the same on
    every machine and after every restart, so a shuffle buffer's state is just ``draws``."""

    def __init__(self, *key: object, draws: int = 0) -> None:
        self._base = hashlib.blake2b(_digest(*key), digest_size=8)
        self.draws = draws

    def below(self, n: int) -> int:
        hasher = self._base.copy()
        hasher.update(self.draws.to_bytes(8, "little"))
        self.draws += 1
        return int.from_bytes(hasher.digest(), "little") % n
