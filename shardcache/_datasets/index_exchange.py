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
only ever clients. One store connection per process: a forked worker makes its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.utils.data

from .._base.dirs import ensure_dir
from .._base.errors import IndexExchangeError, WaitTimeout
from .._base.redact import get_logger
from .._config.rendezvous import Rendezvous
from ..distributed import wait_for

logger = get_logger(__name__)

_stores: dict[tuple[int, str, int], dist.Store] = {}  # by (pid, host, port)


def serve(meet: Rendezvous, timeout: float) -> None:
    """Start serving the job's store in this process (task 0 of a SLURM step, making the
    dataset), unless it does already."""
    if meet.serve and not _in_worker():
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
    kind = _Files if meet.directory is not None else _Store
    parts = kind(meet, key, world_size, timeout)
    if give is not None and not parts.has(rank):
        part = give()
        if part.get("error") and meet.directory is not None:
            return [part if other == rank else {} for other in range(world_size)]
        parts.put(rank, json.dumps(part).encode())
    if not wait:
        return None
    parts.wait()
    return [json.loads(parts.get(other)) for other in range(world_size)]


class _Store:
    """The parts as keys ``part/<rank>`` of the job's store."""

    def __init__(self, meet: Rendezvous, key: str, world_size: int, timeout: float) -> None:
        self.meet, self.timeout = meet, timeout
        self.store = dist.PrefixStore(
            f"shardcache/index/{meet.namespace}/{key}/", _client(meet, timeout)
        )
        self.names = [f"part/{rank}" for rank in range(world_size)]

    def has(self, rank: int) -> bool:
        return self.store.check([self.names[rank]])

    def put(self, rank: int, data: bytes) -> None:
        self.store.set(self.names[rank], data)

    def get(self, rank: int) -> bytes:
        return self.store.get(self.names[rank])

    def wait(self) -> None:
        try:
            self.store.wait(self.names, timedelta(seconds=self.timeout))
        except dist.DistError as exc:
            raise _missing(self.meet, self.store, self.names, self.timeout, exc) from exc


class _Files:
    """The parts as files ``part-<rank>.json`` in the shared directory, in a folder of the
    job and the index, each written whole (renamed into place)."""

    def __init__(self, meet: Rendezvous, key: str, world_size: int, timeout: float) -> None:
        assert meet.directory is not None
        self.meet, self.timeout = meet, timeout
        self.folder = meet.directory / meet.namespace / key
        self.paths = [self.folder / f"part-{rank}.json" for rank in range(world_size)]

    def has(self, rank: int) -> bool:
        return self.paths[rank].exists()

    def put(self, rank: int, data: bytes) -> None:
        ensure_dir(self.folder)
        temporary = self.folder / f".part-{rank}.{os.getpid()}.tmp"
        with temporary.open("wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, self.paths[rank])

    def get(self, rank: int) -> bytes:
        return self.paths[rank].read_bytes()

    def wait(self) -> None:
        what, every = "every rank's part of the sample index", self.paths
        try:
            wait_for(lambda: all(map(Path.exists, every)), what, self.timeout, every[0])
        except WaitTimeout as exc:
            missing = [rank for rank, path in enumerate(every) if not path.exists()]
            raise _named(self.meet, missing, len(every), self.timeout, exc) from exc


def _client(meet: Rendezvous, timeout: float) -> dist.Store:
    """This process's connection to the store: made once a process, serving it where this
    process is the one to (task 0's training process), else a client (a forked DataLoader
    worker makes its own)."""
    store = _stores.get((os.getpid(), meet.host, meet.port))
    if store is not None:
        return store
    if meet.serve and not _in_worker():
        try:
            store = _tcp_store(meet, timeout, serving=True)
        except dist.DistError as exc:  # the port is taken: perhaps by this job already
            logger.warning(
                "cannot serve the job's store for sharing the sample index at port %d (%s); "
                "connecting to what serves there. SHARDCACHE_RENDEZVOUS_PORT sets another "
                "port (the same in every task)",
                meet.port,
                str(exc)[:200],
            )
    try:
        store = store or _tcp_store(meet, timeout, serving=False)
    except dist.DistError as exc:
        raise IndexExchangeError(
            f"cannot reach {meet.describe()} within {timeout:g}s to share learning the "
            f"sample index ({str(exc)[:200]}): " + _advice(meet),
            missing=[0] if meet.launcher == "SLURM" else [],
            store=f"{meet.host}:{meet.port}",
            timeout=timeout,
        ) from exc
    _stores[os.getpid(), meet.host, meet.port] = store
    return store


def _tcp_store(meet: Rendezvous, timeout: float, *, serving: bool) -> dist.Store:
    return dist.TCPStore(
        meet.host,
        meet.port,
        is_master=serving,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


def _missing(
    meet: Rendezvous, store: dist.Store, names: list[str], timeout: float, exc: Exception
) -> IndexExchangeError:
    try:
        missing = [rank for rank, name in enumerate(names) if not store.check([name])]
    except dist.DistError as gone:
        return IndexExchangeError(
            f"{meet.describe()} went away while this rank waited for the others' parts of "
            f"the sample index ({str(gone)[:200]}): whatever serves it ended (a failed "
            "task 0, the end of the job); see that process's error first, then " + _advice(meet),
            missing=None,
            store=f"{meet.host}:{meet.port}",
            timeout=timeout,
        )
    return _named(meet, missing, len(names), timeout, exc)


def _named(
    meet: Rendezvous, missing: list[int], ranks: int, timeout: float, exc: Exception
) -> IndexExchangeError:
    shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
    return IndexExchangeError(
        f"ranks {shown} of {ranks} gave no part of the sample index through "
        f"{meet.describe()} within {timeout:g}s ({type(exc).__name__}): " + _advice(meet),
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
