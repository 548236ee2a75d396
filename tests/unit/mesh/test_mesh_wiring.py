"""A dataset's peers in the cache mesh (``_datasets.mesh_wiring``): each shard's holders
from the hand-out (node *i* for cache *i* at node scope, rank *r*'s node at rank scope), what
it is from the dataset lock, the shards offered to the node's server; no peer without a lock
or where the ranks do not map onto nodes; the holders carried into a pickled cache (a
DataLoader worker's) with the addresses heard, and a second dataset's added."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest

from shardcache import ShardCache
from shardcache._datasets.dataset_lock import DatasetLock, ShardIdentity
from shardcache._datasets.epoch_split import EpochSplit
from shardcache._datasets.mesh_wiring import HandOut, _placement, attach, mesh_peers
from shardcache._meeting.board import DirectoryBoard
from shardcache._mesh.auth import JobKey
from shardcache._mesh.client import Bounds, Peer
from shardcache._mesh.discovery import MeshMembership, MeshRecord, record_name
from shardcache._mesh.holders import Holding, PeerSource
from shardcache._mesh.node import MeshNode, Offered
from shardcache._mesh.verify import Expected

KEY = JobKey(b"k" * 32, "job")
URLS = [f"s3://bucket/train-{i}.tar" for i in range(4)]
LOCK = DatasetLock({url: ShardIdentity(100 + i, f'"e{i}"', f"v{i}") for i, url in enumerate(URLS)})
PEER = Peer("10.0.0.2", 40001)


@pytest.fixture
def cache(tmp_path: Path) -> ShardCache:
    """Node 0's cache in a two-node job whose node 1 published its server on the board."""
    board = DirectoryBoard(tmp_path / "meet", "the mesh's node addresses")
    board.put(record_name(1), MeshRecord(PEER.host, PEER.port, 1, "boot", 7, "f" * 16).encode())
    membership = MeshMembership(0, 2, KEY, "f" * 16, board=lambda: board, timeout=10)
    assert membership.wait(10)
    made = ShardCache(tmp_path / "cache", scope="node")
    made.mesh = MeshNode(membership, None, Offered(), Bounds(min_rate=1e6))
    return made


def _split() -> EpochSplit:
    return EpochSplit([[0, 512, 1024]] * len(URLS), seed=0, shuffle=True, remainder="pad")


def test_holders_come_from_the_hand_out_and_identities_from_the_lock(cache: ShardCache) -> None:
    split = _split()
    source = mesh_peers(cache, split, LOCK, URLS, URLS, (0, 2, 1))
    assert source is not None and source.key == KEY and source.bounds.min_rate == 1e6
    theirs = set(split.shard_units(2)[1])
    assert 0 < len(theirs) < len(URLS)
    for index, url in enumerate(URLS):
        shard = cache._identify(url)
        wanted = [Holding(PEER, "node")] if index in theirs else []  # never this node's own
        assert source.holders(shard) == wanted, url
        assert source.expected(shard) == Expected(100 + index, f'"e{index}"', f"v{index}")
        assert cache.mesh is not None and cache.mesh.offered(shard.canonical_url, shard.namespace)

    attach(cache, source)  # the WebDataset stage does so in each process that iterates
    copy = pickle.loads(pickle.dumps(cache))  # a DataLoader worker's (spawned) copy
    for url in URLS:
        shard = copy._identify(url)
        assert copy._peer_source is not None
        assert copy._peer_source.holders(shard) == source.holders(shard)
        assert copy._peer_source.expected(shard) == source.expected(shard)


def test_a_second_dataset_through_the_same_cache_adds_its_shards(cache: ShardCache) -> None:
    first = HandOut(None, {URLS[0]: ((1, "node"),)}, {}, {1: PEER})
    other = Peer("10.0.0.3", 40002)
    second = HandOut(None, {URLS[1]: ((2, "node"),)}, {URLS[1]: Expected(5)}, {2: other})
    attach(cache, PeerSource(KEY, first, first.expected))
    attach(cache, PeerSource(KEY, second, second.expected))
    given = cache._peer_source
    assert given is not None and given.holders is first
    assert given.holders(cache._identify(URLS[0])) == [Holding(PEER, "node")]
    assert given.expected(cache._identify(URLS[1])) == Expected(5)
    assert given.holders(cache._identify(URLS[1])) == []  # node 2 never heard of here


def test_without_a_lock_no_peer_is_asked_but_the_shards_are_offered(
    cache: ShardCache, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="shardcache"):
        assert mesh_peers(cache, _split(), None, URLS, URLS, (0, 2, 1)) is None
    assert "has no lock" in caplog.text
    shard = cache._identify(URLS[0])
    assert cache.mesh is not None and cache.mesh.offered(shard.canonical_url, shard.namespace)


def test_caches_map_onto_nodes_only_with_consecutive_ranks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    units, node_of, scope_of = _placement("node", (5, 8, 4), 1) or (0, None, None)
    assert (units, node_of(1), scope_of(1)) == (2, 1, "node")  # type: ignore[misc]
    units, node_of, scope_of = _placement("rank", (5, 8, 4), 1) or (0, None, None)
    assert (units, node_of(5), scope_of(5)) == (8, 1, "rank-5")  # type: ignore[misc]
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        assert _placement("node", (5, 8, 4), 0) is None  # rank 5 is not on node 0
        assert _placement("node", (5, 8, None), 1) is None  # no ranks a node known
    assert caplog.text.count("misses go to the store") == 2


def test_with_a_global_shuffle_the_holders_are_epoch_0s_deal_and_others_are_visitors(
    cache: ShardCache,
) -> None:
    """Epoch 0's deal is where every shard was first read: its cache holds it; a shard
    outside this cache's share of it lands as a visitor (evicted first)."""
    starts = [[0, 512, 1024]] * len(URLS)
    split = EpochSplit(starts, seed=0, shuffle=True, remainder="pad", scope="global")
    source = mesh_peers(cache, split, LOCK, URLS, URLS, (0, 2, 1))
    assert source is not None and source.visiting is not None
    mine, theirs = (set(shards) for shards in split.shard_units(2))
    assert any(set(split.shard_units(2, 1, epoch)[0]) != mine for epoch in range(1, 4))
    for index, url in enumerate(URLS):
        shard = cache._identify(url)
        assert source.holders(shard) == ([Holding(PEER, "node")] if index in theirs else [])
        assert source.visiting(shard) == (index not in mine)
    copy = pickle.loads(pickle.dumps(source))  # a DataLoader worker's
    assert copy.visiting is not None
    assert [copy.visiting(cache._identify(url)) for url in URLS] == [
        source.visiting(cache._identify(url)) for url in URLS
    ]
