"""The arguments of a resumable dataset, checked: each wrong one a ``ConfigError`` naming the
argument, its value and what it must be, raised when the dataset is made (before anything is
fetched)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from .._base.errors import ConfigError
from .epoch_split import REMAINDERS
from .job_index import KEEPS
from .urls import Spec, expand_urls
from .wds import STDIN_URL


def resumable_urls(urls: Spec) -> list[str]:
    """The shard URLs of ``urls``; standard input is refused (it cannot be read again)."""
    expanded = expand_urls(urls)
    if STDIN_URL in expanded:
        raise ConfigError(
            "ResumableDataset cannot read standard input ('-'): a resumable shard must "
            "be read again from an offset; put the data in a file or bucket",
            name="urls",
            value=STDIN_URL,
        )
    return expanded


def flag(name: str, value: Any) -> bool:
    """``value`` if it is True or False, else a ConfigError."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, not {value!r}", name=name, value=value)
    return value


def remainder_rule(remainder: str) -> str:
    """``remainder`` if it is one of :data:`REMAINDERS`, else a ConfigError saying what each
    does."""
    if remainder not in REMAINDERS:
        raise ConfigError(
            f"remainder must be one of {REMAINDERS}, not {remainder!r}: 'pad' repeats "
            "samples so that every consumer gets the same number, 'drop' leaves the rest "
            "out of the epoch",
            name="remainder",
            value=remainder,
        )
    return remainder


def index_location(index: Any) -> str | None:
    """The path or URL of a sample index file (None: none given), else a ConfigError."""
    if index is None:
        return None
    if not isinstance(index, (str, os.PathLike)):
        raise ConfigError(
            f"index must be a path or URL of a sample index file, not {index!r:.80}",
            name="index",
            value=index,
        )
    return os.fspath(index)


def index_keeping(keep: Any) -> str:
    """``keep_index`` if it is one of :data:`KEEPS`, else a ConfigError saying what each does."""
    if keep not in KEEPS:
        raise ConfigError(
            f"keep_index must be one of {KEEPS}, not {keep!r}: 'cache' keeps a learned "
            "sample index in the cache root, 'data' also beside the shards (where the store "
            "is writable) for every cache that reads them",
            name="keep_index",
            value=keep,
        )
    return str(keep)


def rank_and_world_size(rank: Any, world_size: Any) -> tuple[int | None, int | None]:
    """Both given (rank below world size), or neither (None, None: detected later)."""
    if (rank is None) != (world_size is None):
        raise ConfigError(
            "give both rank and world_size, or neither (then they are detected)",
            name="rank" if rank is None else "world_size",
            value=None,
        )
    if world_size is not None:
        world_size = whole("world_size", world_size, low=1)
        rank = whole("rank", rank, low=0)
        if rank >= world_size:
            raise ConfigError(
                f"rank {rank} is not below world_size {world_size}",
                name="rank",
                value=rank,
            )
    return rank, world_size


def whole(name: str, value: Any, *, low: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``low``, else a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(
            f"{name} must be a whole number >= {low}, not {value!r}", name=name, value=value
        )
    return value


def refuse_persistent_workers() -> Iterator[Any]:
    """An iterator that raises the ``ConfigError`` of a second iteration in one
    DataLoader worker (persistent workers) from its first ``next()``."""
    raise ConfigError(
        "ResumableDataset was iterated twice in one DataLoader worker: the workers are "
        "persistent (persistent_workers=True), and set_epoch() in the main process does not "
        "reach them, so every epoch would repeat the first one's order. Use "
        "persistent_workers=False (the default)",
        name="persistent_workers",
        value=True,
    )
    yield  # a generator: the error comes from the first next()


__all__ = [
    "flag",
    "index_keeping",
    "index_location",
    "rank_and_world_size",
    "refuse_persistent_workers",
    "remainder_rule",
    "resumable_urls",
    "whole",
]
