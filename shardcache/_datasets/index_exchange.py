"""The parts of a job's sample index exchanged without a torch.distributed process group,
through the store the job already has (:mod:`shardcache._config.rendezvous`): torchrun's
agent store, or the one SLURM task 0 serves for the step; or through files in a shared
directory the user names (``SHARDCACHE_RENDEZVOUS_DIR``).

Each rank's part goes under ``part/<rank>`` in the job's namespace, once (a part already
there is not learned again); a rank waits for the parts it lacks within the bound
(``SHARDCACHE_RENDEZVOUS_TIMEOUT``), and a rank not heard from by then is an
:class:`~shardcache.IndexExchangeError` naming it. The store lives as long as the job's
own: torchrun's agent, or task 0's training process, which starts serving when it makes
the dataset (:func:`serve`), so DataLoader workers, which come and go with the epochs, are
only ever clients. The store and the files are :mod:`shardcache._meeting.board`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from .._base.errors import IndexExchangeError
from .._config.rendezvous import Rendezvous
from .._meeting.board import DirectoryBoard, StoreBoard, Waited, in_worker, shared_store


def serve(meet: Rendezvous, timeout: float) -> None:
    """Start serving the job's store in this process (task 0 of a SLURM step, making the
    dataset), unless it does already."""
    if meet.serve and not in_worker():
        _client(meet, timeout)


def exchange(
    meet: Rendezvous,
    key: str,
    rank: int,
    world_size: int,
    give: Callable[[], Mapping[str, Any]] | None,
    *,
    wait: bool,
    timeout: float,
) -> list[Any] | None:
    """Every rank's part, in rank order, after giving this rank's (``give`` makes it, once
    in the job: None when another process of this rank gives it); without ``wait`` (this
    rank found a kept index and needs nobody's part) only this rank's is given, and None
    returned. A part that failed is given through a store (the others raise it at once),
    not written to a shared directory (it would stay for the next job): the others name
    its rank after the bound."""
    if give is None and not wait:
        return None
    board: StoreBoard | DirectoryBoard
    if meet.directory is not None:
        board = DirectoryBoard(
            meet.directory / meet.namespace / key, "every rank's part of the sample index"
        )
        names = [f"part-{rank}" for rank in range(world_size)]
    else:
        board = StoreBoard(_client(meet, timeout), f"shardcache/index/{meet.namespace}/{key}/")
        names = [f"part/{rank}" for rank in range(world_size)]
    if give is not None and not board.has(names[rank]):
        part = give()
        if part.get("error") and meet.directory is not None:
            return [part if other == rank else {} for other in range(world_size)]
        board.put(names[rank], json.dumps(part).encode())
    if not wait:
        return None
    waited = board.wait(names, timeout)
    if waited.gone is not None:
        raise IndexExchangeError(
            f"{meet.describe()} went away while this rank waited for the others' parts of "
            f"the sample index ({waited.gone}): whatever serves it ended (a failed "
            "task 0, the end of the job); see that process's error first, then " + _advice(meet),
            missing=None,
            store=f"{meet.host}:{meet.port}",
            timeout=timeout,
        )
    if waited.missing:
        raise _named(meet, waited, world_size, timeout)
    return [json.loads(board.get(name)) for name in names]


def _client(meet: Rendezvous, timeout: float) -> Any:
    """This process's connection to the job's store (:func:`shared_store`)."""
    try:
        return shared_store(meet, timeout)
    except dist.DistError as exc:
        raise IndexExchangeError(
            f"cannot reach {meet.describe()} within {timeout:g}s to share learning the "
            f"sample index ({str(exc)[:200]}): " + _advice(meet),
            missing=[0] if meet.launcher == "SLURM" else [],
            store=f"{meet.host}:{meet.port}",
            timeout=timeout,
        ) from exc


def _named(meet: Rendezvous, waited: Waited, ranks: int, timeout: float) -> IndexExchangeError:
    missing = waited.missing
    shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
    return IndexExchangeError(
        f"ranks {shown} of {ranks} gave no part of the sample index through "
        f"{meet.describe()} within {timeout:g}s ({waited.why}): " + _advice(meet),
        missing=missing,
        store=str(meet.directory) if meet.directory else f"{meet.host}:{meet.port}",
        timeout=timeout,
    )


def _advice(meet: Rendezvous) -> str:
    where = ""
    if meet.directory is not None:
        where = f"every rank must see {meet.directory} (a shared file system), "
    elif meet.launcher == "SLURM":
        where = (
            "task 0 serves it on the step's first node: check that every task reaches that "
            "node at this port (SHARDCACHE_RENDEZVOUS_PORT sets another), "
        )
    return (
        "every rank must iterate the dataset (or call prepare()) with the same shards and "
        f"layout; {where}raise SHARDCACHE_RENDEZVOUS_TIMEOUT if the ranks are slow to learn "
        "their shards, or make an index ahead (shardcache index) and give it as index="
    )
