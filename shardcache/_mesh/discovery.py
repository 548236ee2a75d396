"""Discovery: each node's mesh server publishes its address, and every process of the job
with the mesh on reads the other nodes' (:class:`MeshMembership`).

The record is ``mesh/<node>`` = ``{host, port, node, boot_id, pid, fingerprint}`` under the
job's rendezvous namespace, a key of the job's store or a file ``mesh/<node>.json`` renamed
into place in the shared directory (:mod:`shardcache._meeting.board`). A reader waits for the
others in a background thread, at most the rendezvous timeout: a node that never publishes
is simply absent (its shards come from the store), and a node whose key's fingerprint
differs from this one's is left out with a log line that says why. Nothing here blocks the
caller.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from .._meeting.board import Waited
from .auth import JobKey
from .client import Peer

logger = logging.getLogger("shardcache.mesh")

_FIRST_ROUND, _LONGEST_ROUND = 1.0, 60.0  # seconds of one wait for the records not read yet


class Board(Protocol):
    """What discovery needs of a notice board (:mod:`shardcache._meeting.board`)."""

    def put(self, name: str, data: bytes) -> None: ...
    def get_many(self, names: Sequence[str]) -> list[bytes]: ...
    def wait(self, names: Sequence[str], timeout: float) -> Waited: ...


@dataclass(frozen=True)
class MeshRecord:
    """A node's mesh server as it publishes itself."""

    host: str
    port: int
    node: int
    boot_id: str
    pid: int
    fingerprint: str

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> MeshRecord:
        """The record in ``data``; ``ValueError`` saying what is wrong with it."""
        fields = json.loads(data)
        if not isinstance(fields, dict) or set(fields) != {f.name for f in _FIELDS}:
            raise ValueError(f"not a mesh record: {data[:200]!r}")
        for field in _FIELDS:  # annotations are strings here: "str", "int"
            if type(fields[field.name]).__name__ != field.type:
                raise ValueError(f"a mesh record whose {field.name} is not {field.type}")
        if not 0 < fields["port"] < 65536:
            raise ValueError(f"a mesh record with port {fields['port']}")
        return cls(**fields)

    @property
    def peer(self) -> Peer:
        return Peer(self.host, self.port)


_FIELDS = dataclasses.fields(MeshRecord)


def record_name(node: int) -> str:
    """The name of node ``node``'s record on the board."""
    return f"mesh/{node}"


class MeshMembership:
    """The job's mesh as this process knows it: its own node, the job key, and the peers
    (node -> :class:`Peer`) heard from so far, read in a background thread until every
    other node was heard from or ``timeout`` seconds have passed."""

    def __init__(
        self,
        own_node: int,
        nodes: int,
        job_key: JobKey,
        fingerprint: str,
        *,
        board: Callable[[], Board],
        timeout: float,
    ) -> None:
        self.own_node, self.nodes, self.job_key = own_node, nodes, job_key
        self.fingerprint = fingerprint
        self._peers: dict[int, Peer] = {}
        self.refused: dict[int, str] = {}  # node -> why it was left out
        self.absent: list[int] = []  # nodes not heard from within the bound
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._reader = threading.Thread(
            target=self._read, args=(board, timeout), name="shardcache-mesh-discovery", daemon=True
        )
        self._reader.start()

    def peers(self) -> Mapping[int, Peer]:
        """The other nodes' servers heard from so far (never this node's own)."""
        return dict(self._peers)  # replaced whole, never changed: no lock a fork could hold

    def wait(self, timeout: float) -> bool:
        """Wait until the reading ended (every node heard from, refused or given up on), at
        most ``timeout`` seconds; whether it has."""
        return self._done.wait(timeout)

    def _read(self, make_board: Callable[[], Board], timeout: float) -> None:
        """Wait for the records not read yet, in rounds that double from 1 s to a minute, and
        read those that arrived at each round's end in one request: two requests when every
        node publishes within the first round, whatever the node count; then the nodes still
        missing only."""
        deadline = time.monotonic() + timeout
        unknown = [node for node in range(self.nodes) if node != self.own_node]
        round_ = _FIRST_ROUND
        try:
            board = make_board()
            while unknown and (left := deadline - time.monotonic()) > 0:
                waited = board.wait([record_name(n) for n in unknown], min(round_, left))
                if waited.gone is not None:
                    logger.warning("cache mesh: the job's store went away: %s", waited.gone)
                    break
                missing = {unknown[at] for at in waited.missing}
                arrived = [node for node in unknown if node not in missing]
                if arrived:
                    records = board.get_many([record_name(n) for n in arrived])
                    for node, data in zip(arrived, records, strict=True):
                        self._judge(node, data)
                unknown = [node for node in unknown if node in missing]
                round_ = min(round_ * 2, _LONGEST_ROUND)
        except Exception as exc:  # discovery never stops training: the store serves all
            logger.warning(
                "cache mesh: reading the other nodes' addresses failed (%s: %s); shards of "
                "nodes not heard from come from the store",
                type(exc).__name__,
                exc,
            )
        finally:
            self.absent = unknown
            if unknown:
                logger.warning(
                    "cache mesh: nodes %s of %d published no address within %.0f s; their "
                    "shards come from the store",
                    ", ".join(map(str, unknown)),
                    self.nodes,
                    timeout,
                )
            self._done.set()

    def _judge(self, node: int, data: bytes) -> None:
        try:
            record = MeshRecord.decode(data)
        except ValueError as exc:
            self._refuse(node, str(exc))
            return
        if record.node != node:
            self._refuse(node, f"its record names node {record.node}")
        elif record.fingerprint != self.fingerprint:
            self._refuse(
                node,
                f"its mesh key has fingerprint {record.fingerprint}, this node's "
                f"{self.fingerprint}: the nodes were given different secrets (set the same "
                "SHARDCACHE_MESH_SECRET for the whole job, or share the key file through the "
                "home directory)",
            )
        else:
            with self._lock:
                self._peers = {**self._peers, node: record.peer}

    def _refuse(self, node: int, why: str) -> None:
        self.refused[node] = why
        logger.warning("cache mesh: node %d is left out: %s", node, why)
