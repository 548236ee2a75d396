"""A cache mesh peer in its own process: ``python mesh_peer.py CACHE_DIR JOB ALLOWED_JSON
[UPLOAD_RATE]`` serves the published shards of the cache at CACHE_DIR (node scope) that
ALLOWED_JSON lists (``[[canonical_url, namespace], ...]``) on 127.0.0.1, with the secret
read from stdin's first line (hex); prints its port, and serves until stdin closes."""

from __future__ import annotations

import json
import sys

from shardcache._disk.layout import CacheLayout, scope_dir
from shardcache._mesh.auth import JobKey, Verifier
from shardcache._mesh.served import ServedShards
from shardcache._mesh.server import MeshServer


def main() -> None:
    root, job, allowed_json = sys.argv[1:4]
    rate = float(sys.argv[4]) if len(sys.argv) > 4 else None
    secret = bytes.fromhex(sys.stdin.readline().strip())
    allowed = {tuple(pair) for pair in json.loads(allowed_json)}
    layout = CacheLayout(scope_dir(root, "node", 0))
    shards = ServedShards({"node": layout}, lambda url, ns: (url, ns) in allowed)
    with MeshServer(shards, Verifier(JobKey(secret, job)), "127.0.0.1", upload_rate=rate) as server:
        print(server.port, flush=True)
        sys.stdin.read()  # until the test closes stdin (or dies)


if __name__ == "__main__":
    main()
