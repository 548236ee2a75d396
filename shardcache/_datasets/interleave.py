"""The order a consumer takes its mixture's sources in: Tijdeman's chairman assignment
(:func:`next_source`), every prefix of the order less than one sample off each source's
proportion; an epoch's whole order computed once and read back a byte a sample; an epoch
of several steps mixed step by step.

Where an order is computed. The DataLoader's worker count is not visible to the dataset in
the training process, and its workers are new processes every epoch, so an order kept in a
worker's memory dies with it. Three places, tried in turn:

- handed to the workers with the dataset (``kept``), when the training process computed
  them for a worker count it was told (``MixtureDataset.prepare(workers=)``);
- kept on disk (``folder``: the cache root's ``.orders/``, one file a consumer's counts):
  the first worker to need an order computes and writes it, every later epoch's workers,
  the other ranks sharing the cache and the next job read it (a file read, not a schedule
  step a sample). Nothing to call: only the first epoch of the first job computes;
- computed in the process and kept for its later epochs.

An order in a closed form, evaluated sample by sample, was not chosen: the chairman
assignment is an earliest-deadline choice among the sources due, a step of Python a
sample (the cost being removed), and a simpler rule (e.g. sorting ``(j + 1/2) / share``)
would change every mixture's order and loosen the proportions' bound.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._base.errors import ShardCacheError
from .._base.redact import get_logger
from .._disk.layout import CacheLayout
from .._disk.metadata import write_record
from .mixture_schedule import remaining

logger = get_logger(__name__)

ORDER_FORMAT = "shardcache-order"
ORDER_VERSION = 1


def next_source(taken: Sequence[int], shares: Sequence[int]) -> int:
    """The source to take the next sample from (-1: none left), by Tijdeman's solution of
    the chairman assignment problem: with ``k`` sources, the ``j``-th sample of source
    ``i`` is due within the steps ``t`` where ``|j - t * p_i| <= 1 - 1/(2k - 2)`` allows
    it (``p_i`` its share of the total), and of the sources whose next sample is due, the
    one with the earliest last step goes first (ties: the first). Every prefix of the
    sequence then holds every source less than one sample off its proportion.

    ``taken`` and ``shares`` are counts (whole numbers >= 0). Run once a sample, so in one
    pass of integer arithmetic: source ``i``'s next sample is due when ``(taken[i] * m + 1)
    * total <= step * m * shares[i]`` (``m = 2k - 2``, ``step`` the sample's number), and
    its last step, ``((taken[i] + 1) * m - 1) / shares[i]`` in units of ``total / m``
    steps, is compared across sources by cross-multiplying."""
    n = len(shares)
    if len(taken) != n:
        raise ValueError(f"{len(taken)} counts taken for {n} shares")
    m = 2 * (n - shares.count(0)) - 2
    total = sum(shares)
    m_total, step_m, m_1 = m * total, (sum(taken) + 1) * m, m - 1
    best, best_due, best_share = -1, 1, 0  # 0 / 1: later than any source that has a sample left
    for i, done in enumerate(taken):
        share = shares[i]
        if done < share and done * m_total + total <= step_m * share:
            due = done * m + m_1
            if due * best_share < best_due * share:
                best, best_due, best_share = i, due, share
    if best >= 0:
        return best
    for i, done in enumerate(taken):  # none due (one source with samples, or counts off it)
        share = shares[i]
        if done < share:
            due = done * m + m_1
            if due * best_share < best_due * share:
                best, best_due, best_share = i, due, share
    return best


ORDER_LIMIT = 1 << 26  # samples of the longest order kept (1 byte each), see picks()


def picks(
    taken: Sequence[int],
    shares: Sequence[int],
    kept: Mapping[tuple[int, ...], bytes] | None = None,
    stored: Stored | None = None,
) -> Iterator[int]:
    """The sources to take the rest of an epoch's samples from, in order: the
    :func:`next_source` picks from ``taken`` on. When ``taken`` is a prefix of the epoch's
    whole order (a fresh epoch, an exact resume), that order is read from memory: from
    ``kept`` (orders computed ahead, by :func:`order`) when it has these ``shares``, else
    from ``stored`` (a cache's ``.orders/``, written there when missing), else computed
    once a process (one byte a sample) and kept for the next epochs, so mixing costs a
    lookup a sample, not a schedule step."""
    step = sum(taken)
    if len(shares) <= 256 and sum(shares) <= ORDER_LIMIT:
        key = tuple(shares)
        order = kept[key] if kept is not None and key in kept else _order(key, stored)
        if all(order.count(i, 0, step) == done for i, done in enumerate(taken)):
            return iter(memoryview(order)[step:])
    return _online(list(taken), shares)


def stepped_picks(
    taken: Sequence[int],
    steps: Sequence[Sequence[int]],
    kept: Mapping[tuple[int, ...], bytes] | None = None,
    stored: Stored | None = None,
) -> Iterator[int]:
    """The sources to take the rest of an epoch's samples from when the epoch is mixed in
    ``steps`` (each the samples of every source, one after another): each step's
    :func:`picks`, from where ``taken`` (counts since the epoch began) stands."""
    return itertools.chain.from_iterable(_step_picks(list(taken), steps, kept, stored))


def _step_picks(
    taken: list[int],
    steps: Sequence[Sequence[int]],
    kept: Mapping[tuple[int, ...], bytes] | None,
    stored: Stored | None,
) -> Iterator[Iterator[int]]:
    for shares, rest in zip(steps, remaining(steps, taken), strict=True):
        if any(rest):
            done = [s - r for s, r in zip(shares, rest, strict=True)]
            yield picks(done, shares, kept, stored)


def order(shares: Sequence[int]) -> bytes | None:
    """The whole order of an epoch of ``shares`` (a source a byte), if kept (not too long,
    at most 256 sources)."""
    if len(shares) <= 256 and sum(shares) <= ORDER_LIMIT:
        return _order(tuple(shares))
    return None


class Stored:
    """Orders kept in a cache root's ``.orders/`` (:mod:`shardcache._disk` writes them
    atomically), a file a consumer's counts: ``{format, version, shares, order}``, the
    order base64-encoded, checked against its shares when read."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout

    def path(self, shares: tuple[int, ...]) -> Path:
        name = hashlib.blake2b(repr(shares).encode(), digest_size=16).hexdigest()
        return self.layout.root / ".orders" / f"{name}.json"

    def read(self, shares: tuple[int, ...]) -> bytes | None:
        """The kept order of ``shares``; None when missing or not this one's."""
        try:
            document = json.loads(self.path(shares).read_bytes())
            got = base64.b64decode(document["order"], validate=True)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            if not isinstance(exc, FileNotFoundError):
                logger.debug("order of %s not read: %s", shares, exc)
            return None
        header = (document.get("format"), document.get("version"), document.get("shares"))
        if header != (ORDER_FORMAT, ORDER_VERSION, list(shares)) or not _counts_are(got, shares):
            logger.debug("order of %s not read: %s is another order's", shares, header)
            return None
        return got

    def write(self, shares: tuple[int, ...], order: bytes) -> None:
        try:
            write_record(self.layout, self.path(shares), _document(shares, order))
        except (OSError, ShardCacheError) as exc:  # later epochs compute it again
            logger.debug("order of %s not kept: %s", shares, exc)

    def __eq__(self, other: object) -> bool:  # one cache key per cache root
        return isinstance(other, Stored) and other.layout.root == self.layout.root

    def __hash__(self) -> int:
        return hash(self.layout.root)


def forget_orders() -> None:
    """Drop the orders this process keeps: the next one asked for is computed (or read) again."""
    _order.cache_clear()


@functools.lru_cache(maxsize=4)
def _order(shares: tuple[int, ...], stored: Stored | None = None) -> bytes:
    """The whole order of ``shares``: read from ``stored``, else computed (and kept
    there)."""
    found = stored.read(shares) if stored is not None else None
    if found is not None:
        return found
    computed = bytes(_online([0] * len(shares), shares))
    if stored is not None:
        stored.write(shares, computed)
    return computed


def _document(shares: tuple[int, ...], order: bytes) -> dict[str, Any]:
    return {
        "format": ORDER_FORMAT,
        "version": ORDER_VERSION,
        "shares": list(shares),
        "order": base64.b64encode(order).decode(),
    }


def _counts_are(order: bytes, shares: Sequence[int]) -> bool:
    return len(order) == sum(shares) and all(
        order.count(i) == share for i, share in enumerate(shares)
    )


def _online(taken: list[int], shares: Sequence[int]) -> Iterator[int]:
    while (i := next_source(taken, shares)) >= 0:
        taken[i] += 1
        yield i
