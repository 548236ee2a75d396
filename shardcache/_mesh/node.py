"""A process joining the job's cache mesh (``SHARDCACHE_MESH=1``): the job's secret and key,
this node's server (in local rank 0's training process only: never a DataLoader worker, never
another local rank) bound to the cluster address and published on the job's board, and the
reading of the other nodes' addresses (:class:`~.discovery.MeshMembership`).

Once a process: every later cache of the process gets the same membership. Every reason the
mesh cannot run (no meeting point, no node count, no secret, no address, the store not
reached) is one warning saying what to do, and the mesh stays off: training goes on, every
shard from the store. The server stops, and its record in a shared directory is removed,
when the process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from .._base.errors import ConfigError
from .._base.process_identity import boot_id
from .._base.trust import Trust
from .._config.launcher import node_count
from .._config.rendezvous import Rendezvous, rendezvous
from .._config.settings import Settings
from .._disk.layout import CacheLayout
from .._meeting.board import DirectoryBoard, StoreBoard, in_worker, own_store, shared_store
from .address import cluster_address, link_rate
from .auth import JobKey, Verifier
from .client import Bounds
from .discovery import Board, MeshMembership, MeshRecord, record_name
from .secret import default_key_file, fingerprint, job_secret
from .served import ServedShards
from .server import MeshServer

logger = logging.getLogger("shardcache.mesh")

_SCOPE_RE = re.compile(r"node|rank-[0-9]{1,8}")
_joined: dict[int, MeshMembership | None] = {}  # by pid: once a process
_joining = threading.Lock()


class ScopeLayouts(Mapping[str, CacheLayout]):
    """The scope directories of the cache root a node serves (``node`` and every
    ``rank-<R>``: at rank scope, those of all the node's local ranks), made on first ask."""

    def __init__(self, root: Path, trust: Trust) -> None:
        self._root, self._trust = root, trust
        self._made: dict[str, CacheLayout] = {}

    def __getitem__(self, name: str) -> CacheLayout:
        if not _SCOPE_RE.fullmatch(name):
            raise KeyError(name)
        if name not in self._made:
            self._made[name] = CacheLayout(self._root / name, self._trust)
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict(self._made))

    def __len__(self) -> int:
        return len(self._made)


class Offered:
    """The shards of the job's datasets this node serves: (canonical URL, store namespace)
    pairs, added as the job's datasets name them; none until then."""

    def __init__(self) -> None:
        self._pairs: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def add(self, pairs: Iterable[tuple[str, str]]) -> None:
        with self._lock:
            self._pairs.update(pairs)

    def __call__(self, url: str, namespace: str) -> bool:
        with self._lock:
            return (url, namespace) in self._pairs


class MeshNode:
    """This process in the job's mesh: its :attr:`membership`, the :attr:`bounds` a fetch
    from a peer keeps (``SHARDCACHE_MESH_TIMEOUT`` and ``_MIN_RATE``), and where this process
    is local rank 0, its :attr:`server` and the :attr:`offered` shards."""

    def __init__(
        self,
        membership: MeshMembership,
        server: MeshServer | None,
        offered: Offered,
        bounds: Bounds,
    ) -> None:
        self.membership, self.server, self.offered = membership, server, offered
        self.bounds = bounds


def join(settings: Settings) -> MeshNode | None:
    """This process's place in the job's mesh when ``settings.mesh`` is on, made once a
    process; None when the mesh is off (a warning said why, once)."""
    if not settings.mesh:
        return None
    with _joining:
        pid = os.getpid()
        if pid not in _joined:
            _joined[pid] = _join(settings)
        return _joined[pid]


def _off(why: str) -> None:
    logger.warning("the cache mesh stays off: %s; every shard comes from the store", why)


def _join(settings: Settings) -> MeshNode | None:
    meet = rendezvous(settings.rendezvous_port, settings.rendezvous_dir)
    if isinstance(meet, str):
        return _off(
            f"the job's processes have no meeting point ({meet}); run under torchrun or srun, "
            "or set SHARDCACHE_RENDEZVOUS_DIR to a directory every node sees"
        )
    nodes = node_count()
    if nodes is None:
        return _off(
            "the launcher gives no node count (torchrun's GROUP_WORLD_SIZE, SLURM's "
            "SLURM_STEP_NUM_NODES); run under torchrun or srun"
        )
    secret = job_secret(settings.mesh_secret, default_key_file())
    if secret is None:
        return None  # job_secret warned, naming both ways to turn the mesh on
    key, print_ = JobKey(secret, meet.namespace), fingerprint(secret)
    timeout, offered = settings.rendezvous_timeout, Offered()
    try:
        board = _board(meet, timeout, hosting=True)  # task 0 hosts the store from now on
        server = None
        if settings.local_rank == 0 and not in_worker() and settings.mesh_upload_rate != 0:
            server = _serve(settings, meet, board, key=key, print_=print_, offered=offered)
    except Exception as exc:  # the mesh is optional: training goes on without it
        return _off(f"{type(exc).__name__}: {exc}")
    membership = MeshMembership(
        settings.node_rank,
        nodes,
        key,
        print_,
        board=lambda: _board(meet, timeout, hosting=False),
        timeout=timeout,
    )
    bounds = Bounds(timeout=settings.mesh_timeout, min_rate=settings.mesh_min_rate)
    return MeshNode(membership, server, offered, bounds)


def _serve(
    settings: Settings,
    meet: Rendezvous,
    board: Board,
    *,
    key: JobKey,
    print_: str,
    offered: Offered,
) -> MeshServer:
    """This node's server, started on the cluster address and published on ``board``."""
    if settings.mesh_addr is None and not meet.host:
        raise ConfigError(
            f"the cache mesh meets through {meet.describe()}, which names no host to find "
            "this node's cluster address by; set SHARDCACHE_MESH_ADDR to this node's IP "
            "address on the cluster network",
            name="SHARDCACHE_MESH_ADDR",
            value=None,
        )
    host = settings.mesh_addr or cluster_address(meet.host)
    shards = ServedShards(
        ScopeLayouts(settings.cache_dir, Trust.for_group(settings.shared_group)), offered
    )
    server = MeshServer(
        shards,
        Verifier(key),
        host,
        concurrency=settings.mesh_concurrency,
        upload_rate=upload_cap(settings.mesh_upload_rate, host),
    )
    try:
        server.start()
    except OSError as exc:
        raise ConfigError(
            f"the cache mesh cannot listen on {host} ({exc}); expected an IP address of this "
            "node: set SHARDCACHE_MESH_ADDR to this node's address on the cluster network, or "
            "unset it to use the route to the job's store host",
            name="SHARDCACHE_MESH_ADDR",
            value=host,
        ) from exc
    name = record_name(settings.node_rank)
    record = MeshRecord(host, server.port, settings.node_rank, boot_id(), os.getpid(), print_)
    try:
        board.put(name, record.encode())
    except BaseException:
        server.stop()
        raise
    atexit.register(_leave, server, board, name)
    return server


def upload_cap(setting: int | None, host: str) -> float | None:
    """The bytes per second this node serves at most: the setting, else (``auto``) half the
    speed of the interface holding ``host``, else (speed unknown) no cap."""
    if setting is not None:
        return float(setting)
    speed = link_rate(host)
    logger.info(
        "cache mesh: upload cap %s (SHARDCACHE_MESH_UPLOAD_RATE=auto)",
        "none: the interface's speed is unknown" if speed is None else f"{speed / 2e6:g} MB/s",
    )
    return None if speed is None else speed / 2


def _leave(server: MeshServer, board: Board, name: str) -> None:
    """At exit: stop serving, and remove this node's record from a shared directory (a
    store's keys end with the store)."""
    server.stop()
    if isinstance(board, DirectoryBoard):
        with contextlib.suppress(OSError):
            board.path(name).unlink()


def _board(meet: Rendezvous, timeout: float, *, hosting: bool) -> Board:
    """The job's board: the shared directory's ``mesh`` folder, else the store (the
    process's shared connection, hosting it where this is task 0; or one of its own for the
    reading thread)."""
    if meet.directory is not None:
        return DirectoryBoard(meet.directory / meet.namespace, "the mesh's node addresses")
    store = shared_store(meet, timeout) if hosting else own_store(meet, timeout)
    return StoreBoard(store, f"shardcache/{meet.namespace}/")
