"""The order a consumer takes its mixture's sources in: Tijdeman's chairman assignment
(:func:`next_source`), every prefix of the order less than one sample off each source's
proportion; an epoch's whole order computed once a process (or ahead, by the training
process for its DataLoader workers) and read back a byte a sample; an epoch of several
steps mixed step by step.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence

from .mixture_schedule import remaining


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
) -> Iterator[int]:
    """The sources to take the rest of an epoch's samples from, in order: the
    :func:`next_source` picks from ``taken`` on. When ``taken`` is a prefix of the epoch's
    whole order (a fresh epoch, an exact resume), that order is read from memory: from
    ``kept`` (orders computed ahead, by :func:`order`) when it has these ``shares``, else
    computed once a process (one byte a sample) and kept for the next epochs, so mixing
    costs a lookup a sample, not a schedule step."""
    step = sum(taken)
    if len(shares) <= 256 and sum(shares) <= ORDER_LIMIT:
        key = tuple(shares)
        order = kept[key] if kept is not None and key in kept else _order(key)
        if all(order.count(i, 0, step) == done for i, done in enumerate(taken)):
            return iter(memoryview(order)[step:])
    return _online(list(taken), shares)


def stepped_picks(
    taken: Sequence[int],
    steps: Sequence[Sequence[int]],
    kept: Mapping[tuple[int, ...], bytes] | None = None,
) -> Iterator[int]:
    """The sources to take the rest of an epoch's samples from when the epoch is mixed in
    ``steps`` (each the samples of every source, one after another): each step's
    :func:`picks`, from where ``taken`` (counts since the epoch began) stands."""
    return itertools.chain.from_iterable(_step_picks(list(taken), steps, kept))


def _step_picks(
    taken: list[int],
    steps: Sequence[Sequence[int]],
    kept: Mapping[tuple[int, ...], bytes] | None,
) -> Iterator[Iterator[int]]:
    for shares, rest in zip(steps, remaining(steps, taken), strict=True):
        if any(rest):
            yield picks([s - r for s, r in zip(shares, rest, strict=True)], shares, kept)


def order(shares: Sequence[int]) -> bytes | None:
    """The whole order of an epoch of ``shares`` (a source a byte), if kept (not too long,
    at most 256 sources)."""
    if len(shares) <= 256 and sum(shares) <= ORDER_LIMIT:
        return _order(tuple(shares))
    return None


@functools.lru_cache(maxsize=4)
def _order(shares: tuple[int, ...]) -> bytes:
    return bytes(_online([0] * len(shares), shares))


def _online(taken: list[int], shares: Sequence[int]) -> Iterator[int]:
    while (i := next_source(taken, shares)) >= 0:
        taken[i] += 1
        yield i
