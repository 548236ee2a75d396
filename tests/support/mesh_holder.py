"""A node's cache for the cache mesh's tests: published shards (fetched from moto by a real
ShardCache), the requests that name them, and what the job may ask for."""

from __future__ import annotations

from shardcache import ShardCache
from shardcache._mesh.served import ServedShards, ShardRequest

BUCKET = "meshshards"
SECRET = bytes(range(32))
JOB = "job-43"


class Holder:
    """A node's cache holding published shards, and what the job may ask for."""

    def __init__(self, cache: ShardCache, blobs: dict[str, bytes], allowed: list[str]) -> None:
        self.cache, self.blobs = cache, blobs
        self.requests = {url: self.request(url) for url in blobs}
        self.allowed = {(self.requests[u].url, self.requests[u].namespace) for u in allowed}

    def request(self, url: str) -> ShardRequest:
        shard = self.cache._identify(url)
        return ShardRequest("node", shard.protocol, shard.namespace, shard.canonical_url)

    def shards(self) -> ServedShards:
        return ServedShards({"node": self.cache.layout}, lambda u, ns: (u, ns) in self.allowed)
