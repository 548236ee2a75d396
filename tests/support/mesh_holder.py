"""A node's cache for the cache mesh's tests: published shards (fetched from moto by a real
ShardCache), the requests that name them, and what the job may ask for."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

from shardcache import ShardCache
from shardcache._disk.layout import ShardId
from shardcache._mesh.holders import Holding
from shardcache._mesh.served import ServedShards, ShardRequest
from shardcache._mesh.verify import Expected

BUCKET = "meshshards"
SECRET = bytes(range(32))
JOB = "job-43"
# A peer's bound (SHARDCACHE_MESH_TIMEOUT) where a test counts the store's GETs exactly: a
# live peer starved by a loaded machine still answers within it, so only a hang exceeds it.
WIDE = 60.0
# Seconds a loaded machine may add to a bound a test checks by the clock: far below the
# next larger bound in play (WIDE), so the check still tells which bound ended the wait.
LOADED = 10.0


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


PEER_SCRIPT = Path(__file__).parent / "mesh_peer.py"


@contextlib.contextmanager
def peer_process(holder: Holder, rate: float | None = None) -> Iterator[tuple[Popen[str], int]]:
    """``holder``'s shards served by a MeshServer in a process of its own (upload cap
    ``rate`` bytes/s, when given): the process and its port, once it listens."""
    allowed = json.dumps(sorted(holder.allowed))
    args = [sys.executable, str(PEER_SCRIPT), str(holder.cache.layout.root), JOB, allowed]
    args += [] if rate is None else [str(rate)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(SECRET.hex() + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()  # the port, once it listens (the test's timeout bounds it)
        assert line.strip().isdigit(), f"the peer process did not start: {line!r}"
        yield proc, int(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@dataclass(frozen=True)
class Copies:
    """Every shard's copies (``PeerSource.holders``, picklable): the same holdings for each."""

    holdings: tuple[Holding, ...]

    def __call__(self, shard: ShardId) -> tuple[Holding, ...]:
        return self.holdings


@dataclass(frozen=True)
class Known:
    """What each shard is known to be, by canonical URL (``PeerSource.expected``, picklable;
    a dataset lock's entries in a job)."""

    identities: tuple[tuple[str, Expected], ...]

    def __call__(self, shard: ShardId) -> Expected | None:
        return dict(self.identities).get(shard.canonical_url)
