"""A job's notice board: records put under names once and read by the job's other
processes, through the store the job already has (torchrun's agent store, or the one SLURM
task 0 hosts for the step; :mod:`shardcache._config.rendezvous` says which) or as files in a
shared directory the user names.

The store lives as long as the job's own: torchrun's agent, or task 0's training process,
which starts hosting it when it makes the dataset or the cache, so DataLoader
workers, which come and go with the epochs, are only ever clients. One shared connection per
process (a forked worker makes its own); a thread that waits long on the store takes one of
its own (:func:`own_store`), since a ``TCPStore`` client holds its lock for a whole wait.
Every wait is bounded; what is still missing after it is said, never raised.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from .._base.dirs import ensure_dir
from .._base.errors import WaitTimeout
from .._base.redact import get_logger
from .._config.rendezvous import Rendezvous
from ..distributed import wait_for

logger = get_logger(__name__)

_stores: dict[tuple[int, str, int], Any] = {}  # by (pid, host, port)


@dataclass(frozen=True)
class Waited:
    """What a bounded wait saw: the names still ``missing`` (their indices in the order
    asked), ``why`` it ended (the wait's exception, by name), and ``gone``: why the store
    itself went away, when it did (then ``missing`` is unknown: empty)."""

    missing: list[int]
    why: str = ""
    gone: str | None = None


def in_worker() -> bool:
    """Whether this process is a DataLoader worker (never one to host a store or serve)."""
    data = sys.modules.get("torch.utils.data")  # imported by the program if it uses torch
    return data is not None and data.get_worker_info() is not None


def shared_store(meet: Rendezvous, timeout: float) -> Any:
    """This process's connection to the store: made once a process, hosting it where this
    process is the one to (task 0's training process), else a client. Raises
    ``torch.distributed.DistError`` when the store cannot be reached within ``timeout``."""
    import torch.distributed as dist

    store = _stores.get((os.getpid(), meet.host, meet.port))
    if store is not None:
        return store
    if meet.serve and not in_worker():
        try:
            store = _tcp_store(meet, timeout, hosting=True)
        except dist.DistError as exc:  # the port is taken: perhaps by this job already
            logger.warning(
                "cannot host the job's store at port %d (%s); connecting to what serves "
                "there. SHARDCACHE_RENDEZVOUS_PORT sets another port (the same in every task)",
                meet.port,
                str(exc)[:200],
            )
    store = store or _tcp_store(meet, timeout, hosting=False)
    _stores[os.getpid(), meet.host, meet.port] = store
    return store


def own_store(meet: Rendezvous, timeout: float) -> Any:
    """A client connection of the caller's own to the store (for a thread that waits on it
    while others use :func:`shared_store`)."""
    return _tcp_store(meet, timeout, hosting=False)


def _tcp_store(meet: Rendezvous, timeout: float, *, hosting: bool) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        meet.host,
        meet.port,
        is_master=hosting,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


class StoreBoard:
    """Records as keys ``<prefix><name>`` of a store connection."""

    def __init__(self, store: Any, prefix: str) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(prefix, store)

    def has(self, name: str) -> bool:
        return bool(self.store.check([name]))

    def put(self, name: str, data: bytes) -> None:
        self.store.set(name, data)

    def get(self, name: str) -> bytes:
        return bytes(self.store.get(name))

    def get_many(self, names: Sequence[str]) -> list[bytes]:
        """The records of ``names`` (all present), in one request where the store has
        ``multi_get`` (torch 2.3 on), else one a name."""
        if not hasattr(self.store, "multi_get"):
            return [self.get(name) for name in names]
        return [bytes(data) for data in self.store.multi_get(list(names))]

    def wait(self, names: Sequence[str], timeout: float) -> Waited:
        import torch.distributed as dist

        try:
            self.store.wait(list(names), timedelta(seconds=timeout))
            return Waited([])
        except dist.DistError as exc:
            why = type(exc).__name__
        try:
            return Waited([at for at, name in enumerate(names) if not self.has(name)], why)
        except dist.DistError as gone:
            return Waited([], why, str(gone)[:200])


class DirectoryBoard:
    """Records as files ``<folder>/<name>.json``, each written whole (renamed into place)."""

    def __init__(self, folder: Path, what: str) -> None:
        self.folder, self.what = folder, what  # what the records are, for a long wait's log

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def has(self, name: str) -> bool:
        return self.path(name).exists()

    def put(self, name: str, data: bytes) -> None:
        ensure_dir(self.path(name).parent)
        final = self.path(name)
        temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with temporary.open("wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, final)

    def get(self, name: str) -> bytes:
        return self.path(name).read_bytes()

    def get_many(self, names: Sequence[str]) -> list[bytes]:
        return [self.get(name) for name in names]

    def wait(self, names: Sequence[str], timeout: float) -> Waited:
        paths = [self.path(name) for name in names]
        try:
            wait_for(lambda: all(map(Path.exists, paths)), self.what, timeout, paths[0])
            return Waited([])
        except WaitTimeout as exc:
            missing = [at for at, path in enumerate(paths) if not path.exists()]
            return Waited(missing, type(exc).__name__)
