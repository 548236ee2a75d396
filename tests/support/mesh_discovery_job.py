"""A torchrun worker with the cache mesh on, for tests/system/test_mesh_discovery_torchrun.py:
``python mesh_discovery_job.py OUT_DIR CACHE_ROOT`` makes its cache (node scope; local rank 0
starts the node's server), waits for the other nodes' addresses without a process group, and
writes what it learned to ``OUT_DIR/node-<GROUP_RANK>-rank-<LOCAL_RANK>.json``; then a gloo
barrier keeps the agents' store up until every worker has read it."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from processes import COLLECTIVE_TIMEOUT

from shardcache import ShardCache


def main() -> None:
    out, root = Path(sys.argv[1]), Path(sys.argv[2]) / os.environ["GROUP_RANK"]
    cache = ShardCache(root, scope="node")
    mesh = cache.mesh
    assert mesh is not None, "the mesh did not start (see the warning above)"
    settled = mesh.membership.wait(2 * COLLECTIVE_TIMEOUT)  # it reads for COLLECTIVE_TIMEOUT
    learned = {
        "settled": settled,
        "node": mesh.membership.own_node,
        "job": mesh.membership.job_key.job,
        "port": mesh.server.port if mesh.server is not None else None,
        "peers": {str(n): [p.host, p.port] for n, p in mesh.membership.peers().items()},
        "refused": mesh.membership.refused,
        "absent": mesh.membership.absent,
    }
    name = f"node-{os.environ['GROUP_RANK']}-rank-{os.environ['LOCAL_RANK']}.json"
    (out / name).write_text(json.dumps(learned))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
