"""What a cache asks the mesh on a miss: :class:`PeerSource`, for a shard, the peers that
hold a copy (from the job's hand-out, later its inventory), what the shard is known to be
(its dataset lock's entry) and the job key and bounds to ask with.

The cache takes one as it is given; how the holders are found (discovery, the hand-out) is
the giver's. Picklable when its callables are (module-level functions or objects), so a
DataLoader worker fills its misses from peers too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .._disk.layout import ShardId
from .auth import JobKey
from .client import Bounds, Peer
from .served import ShardRequest
from .verify import Expected


@dataclass(frozen=True)
class Holding:
    """A copy on ``peer``, in its scope directory named ``scope`` (at node scope every
    node's is the same name)."""

    peer: Peer
    scope: str

    def request(self, shard: ShardId) -> ShardRequest:
        """The request for ``shard``'s copy here."""
        return ShardRequest(self.scope, shard.protocol, shard.namespace, shard.canonical_url)


@dataclass(frozen=True)
class PeerSource:
    """The peers a cache asks before the store. ``holders``: the copies of a shard, asked in
    order; ``expected``: what the shard is known to be (its size, ETag, version), None when
    nothing is known, and then no peer is asked (a peer's copy could be of another version);
    ``key`` signs the requests, ``bounds`` bound each; ``visiting``: whether a shard is
    outside the cache's own share (its copy then lands marked least recently used, evicted
    before the cache's own shards; None: every copy lands as a download does)."""

    key: JobKey
    holders: Callable[[ShardId], Sequence[Holding]]
    expected: Callable[[ShardId], Expected | None]
    bounds: Bounds = field(default_factory=Bounds)
    visiting: Callable[[ShardId], bool] | None = None
