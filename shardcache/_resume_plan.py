"""Who reads what in an epoch: the seeded shard order, the split into consumers, and the
redistribution of what was left undelivered when a job resumes with another shape.

A *consumer* is one DataLoader worker of one rank (slot ``rank * workers + worker``); its
*plan* is an ordered list of :class:`Piece` s. In a fresh epoch consumer ``j`` of ``J``
reads shards ``order[j::J]`` whole. A resumed epoch's plans are explicit: the pieces left
over by the old consumers, dealt out round-robin.

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
    """Samples of shard ``shard`` from byte ``start`` to its end, or (``single``) only the
    sample at ``start``: one that sat in a shuffle buffer when a state was taken."""

    shard: int
    start: int = 0
    single: bool = False

    def as_json(self) -> list[int]:
        return [self.shard, self.start, 1] if self.single else [self.shard, self.start]

    @classmethod
    def from_json(cls, value: Sequence[int]) -> Piece:
        return cls(int(value[0]), int(value[1]), len(value) > 2 and bool(value[2]))


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=16).digest()


def epoch_order(count: int, seed: int, epoch: int, *, shuffle: bool = True) -> list[int]:
    """The shard indices of ``epoch`` in reading order: a permutation drawn from
    ``(seed, epoch)``, or ``0..count-1`` when not shuffling."""
    if not shuffle:
        return list(range(count))
    return sorted(range(count), key=lambda index: _digest(seed, epoch, index))


def fresh_plan(order: Sequence[int], consumers: int, slot: int) -> list[Piece]:
    """Consumer ``slot``'s whole shards in a fresh epoch."""
    return [Piece(shard) for shard in order[slot::consumers]]


def share(leftover: Sequence[Piece], consumers: int, slot: int) -> list[Piece]:
    """Consumer ``slot``'s part of a resumed epoch's leftover pieces: every ``consumers``-th
    one, so that partly read shards, whole ones and buffered samples spread evenly."""
    return list(leftover[slot::consumers])


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
