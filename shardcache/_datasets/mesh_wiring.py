"""A dataset in the job's cache mesh (``SHARDCACHE_MESH=1``): its shards offered to the
node's server, and the :class:`~shardcache._mesh.holders.PeerSource` its cache asks on a
miss, made from the job's hand-out and the dataset lock.

Which node holds a shard is computed, never asked: the hand-out
(:meth:`~shardcache._datasets.epoch_split.EpochSplit.shard_units`) gives every cache the
shards it reads in every epoch, identically on every rank. With ``shuffle_scope="global"``
it is epoch 0's deal: where every shard was first read, each cache's *home* share. A copy
of another shard (a *visitor*, filled from a peer) lands marked least recently used, so
eviction takes visitors before home shards (:class:`~shardcache._mesh.holders.PeerSource`'s
``visiting``). At node scope cache *i* is node
*i*; at rank scope rank *r*'s cache is on node ``r // local_world_size``, its scope
directory ``rank-<r>``. Both need the ranks numbered contiguously per node (as torchrun and
SLURM's default block distribution number them): where this process's rank says another
node than the launcher's node rank, no peer is asked. What a shard is (size, ETag, version)
comes from its dataset lock entry: without a lock no peer is asked either, since a copy
could be of another version.

The holders pickle into DataLoader workers with the addresses heard so far (a forked worker
reads the training process's copy without a lock); a worker only fetches, never serves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._disk.layout import ShardId
from .._mesh.client import Peer
from .._mesh.discovery import MeshMembership
from .._mesh.holders import Holding, PeerSource
from .._mesh.verify import Expected
from .cache_shares import owners
from .dataset_lock import DatasetLock
from .epoch_split import EpochSplit

logger = get_logger(__name__)

Copies = dict[str, tuple[tuple[int, str], ...]]  # read URL -> (node, scope directory), in order


class HandOut:
    """The holders of a dataset's shards by the job's hand-out (a
    :class:`PeerSource`'s ``holders``: called with a shard) and what each shard is
    (:meth:`expected`), with the nodes' addresses from ``membership`` (in the process that
    joined the mesh) or as they were when it was pickled (a DataLoader worker's)."""

    def __init__(
        self,
        membership: MeshMembership | None,
        copies: Copies,
        expected: Mapping[str, Expected],
        peers: Mapping[int, Peer] | None = None,
        home: frozenset[str] = frozenset(),
    ) -> None:
        self._membership = membership
        self._copies = dict(copies)
        self._expected = dict(expected)
        self._known = dict(peers or {})
        self._home = set(home)

    def __call__(self, shard: ShardId) -> list[Holding]:
        """The copies of ``shard`` on nodes heard from, the shard's owner first."""
        peers = self.peers()
        return [
            Holding(peers[node], scope)
            for node, scope in self._copies.get(shard.url, ())
            if node in peers
        ]

    def visiting(self, shard: ShardId) -> bool:
        """Whether ``shard`` is outside this cache's home share (read by it in epoch 0)."""
        return shard.url not in self._home

    def expected(self, shard: ShardId) -> Expected | None:
        """What ``shard`` is, by its dataset lock entry; None for a shard of no lock."""
        return self._expected.get(shard.url)

    def peers(self) -> Mapping[int, Peer]:
        """The other nodes' servers heard from so far."""
        return self._known if self._membership is None else self._membership.peers()

    def merge(self, other: HandOut) -> None:
        """Add the shards of another dataset read through the same cache."""
        self._copies.update(other._copies)
        self._expected.update(other._expected)
        self._home |= other._home

    def __getstate__(self) -> dict[str, Any]:
        peers = dict(self.peers())
        return {
            "copies": self._copies,
            "expected": self._expected,
            "peers": peers,
            "home": self._home,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        given = (state["copies"], state["expected"], state["peers"], frozenset(state["home"]))
        self.__init__(None, *given)  # type: ignore[misc]


def mesh_peers(  # noqa: PLR0917  (the dataset's parts, in one call)
    cache: ShardCache,
    split: EpochSplit,
    lock: DatasetLock | None,
    urls: Sequence[str],
    read_urls: Sequence[str],
    ranks: tuple[int, int, int | None],
) -> PeerSource | None:
    """Offer ``read_urls`` (``urls`` as read: a changed shard pinned to its version) to this
    node's server, and the peers ``cache`` asks for them on a miss: None when the mesh is
    off, or holders or identities cannot be known. ``lock``: the dataset's lock, by plain
    URL; ``ranks``: this process's rank, the world size and the local world size."""
    node = cache.mesh
    if node is None:
        return None
    cache._offer(read_urls)
    if lock is None:
        logger.info(
            "cache mesh: this dataset has no lock (lock=), so what its shards are is not "
            "known: its misses go to the store, not to peers"
        )
        return None
    placed = _placement(cache.settings.scope, ranks, node.membership.own_node)
    if placed is None:
        return None
    units, node_of, scope_of = placed
    per_unit = ranks[1] // units
    owner = owners(split.unit_shares(units, per_unit), len(read_urls))
    holding: list[list[int]] = [[] for _ in read_urls]  # by shard: the caches reading it
    reads = split.shard_units(units, per_unit)  # in every epoch, or epoch 0 ("global")
    for unit, shards in enumerate(reads):
        for shard in shards:
            holding[shard].append(unit)
    own = node.membership.own_node
    copies: Copies = {
        url: tuple(
            (node_of(u), scope_of(u))
            for u in sorted(holding[shard], key=lambda u, s=shard: (u != owner[s], u))
            if node_of(u) != own
        )
        for shard, url in enumerate(read_urls)
    }
    expected = {
        read: Expected(entry.size, entry.etag, entry.version_id)
        for plain, read in zip(urls, read_urls, strict=True)
        if (entry := lock.shards.get(plain)) is not None
    }
    home = frozenset(read_urls[shard] for shard in reads[ranks[0] // per_unit])
    handout = HandOut(node.membership, copies, expected, home=home)
    key = node.membership.job_key
    return PeerSource(key, handout, handout.expected, node.bounds, handout.visiting)


def _placement(
    scope: str, ranks: tuple[int, int, int | None], own_node: int
) -> tuple[int, Callable[[int], int], Callable[[int], str]] | None:
    """The caches of the hand-out, and each one's node and scope directory; None (logged)
    when the ranks do not map onto nodes."""
    rank, world, local = ranks
    if local is None or world % local or rank // local != own_node:
        logger.warning(
            "cache mesh: rank %d of %d is on node %d, which consecutive ranks %s a node would "
            "not place it on; this dataset's misses go to the store, not to peers (number "
            "the ranks node by node, as torchrun and SLURM's block distribution do)",
            *(rank, world, own_node, "of unknown count" if local is None else f"of {local}"),
        )
        return None
    if scope == "node":
        return world // local, (lambda unit: unit), (lambda _unit: "node")
    return world, (lambda unit: unit // local), (lambda unit: f"rank-{unit}")


def attach(cache: ShardCache, source: PeerSource) -> None:
    """Give ``cache`` the peers of ``source``: added to those of another dataset the cache
    already asks for (datasets sharing one cache), else its own."""
    current = cache._peer_source
    if (
        current is not None
        and current is not source
        and isinstance(current.holders, HandOut)
        and isinstance(source.holders, HandOut)
    ):
        current.holders.merge(source.holders)
    elif current is not source:
        cache._attach_peers(source)
