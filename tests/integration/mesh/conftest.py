"""The cache mesh's fixtures: a node's cache holding published shards (``holder``), and a
MeshServer in a thread serving them (``server``)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from mesh_holder import BUCKET, JOB, SECRET, Holder

from shardcache import ShardCache
from shardcache._mesh.auth import JobKey, Verifier
from shardcache._mesh.server import MeshServer


@pytest.fixture
def holder(s3, tmp_path: Path) -> Holder:
    sizes = {"a.tar": 2_500_000, "b.tar": 300_000, "outside.tar": 1000}
    objects = {k: random.Random(k).randbytes(n) for k, n in sizes.items()}
    s3.put_objects(BUCKET, objects)
    cache = ShardCache(tmp_path / "cache", scope="node", retry_backoff=0.01)
    blobs = {f"s3://{BUCKET}/{k}": v for k, v in objects.items()}
    for url in blobs:
        cache.fetch(url)
    return Holder(cache, blobs, [u for u in blobs if "outside" not in u])


@pytest.fixture
def server(holder: Holder) -> Iterator[MeshServer]:
    with MeshServer(holder.shards(), Verifier(JobKey(SECRET, JOB)), "127.0.0.1") as running:
        yield running
