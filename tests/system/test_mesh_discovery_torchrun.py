"""The cache mesh's discovery under torchrun: two agents on this machine form a two-node job
(c10d rendezvous on 127.0.0.1), two workers a node. Through the agents' store and without a
process group, each worker learns the other node's server; local rank 0 of each node serves
(bound to the address of the route to MASTER_ADDR) and local rank 1 only reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ports import reserved_port
from processes import COLLECTIVE_TIMEOUT, JOB_TIMEOUT, job_env
from repo import SUPPORT

JOB = SUPPORT / "mesh_discovery_job.py"
pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)


def agent(port: int, out: Path, root: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=mesh43",
        "--max-restarts=0",
        str(JOB),
        str(out),
        str(root),
    ]


def test_workers_learn_the_other_nodes_server_through_the_agents_store(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    env = job_env(
        SHARDCACHE_MESH="1",
        SHARDCACHE_MESH_SECRET="t" * 32,
        SHARDCACHE_RENDEZVOUS_TIMEOUT=f"{COLLECTIVE_TIMEOUT}s",  # an agent starting late
    )
    with reserved_port() as port:
        agents = [
            subprocess.Popen(
                agent(port, out, root),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            logs = [a.communicate(timeout=JOB_TIMEOUT)[0] for a in agents]  # a hang's bound
        finally:
            for a in agents:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(log[-4000:] for log in logs)
    learned = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(learned) == [f"node-{n}-rank-{r}" for n in (0, 1) for r in (0, 1)]
    ports = {n: learned[f"node-{n}-rank-0"]["port"] for n in (0, 1)}
    for node in (0, 1):
        assert learned[f"node-{node}-rank-1"]["port"] is None  # only local rank 0 serves
        for rank in (0, 1):
            got = learned[f"node-{node}-rank-{rank}"]
            assert got["settled"] and got["node"] == node and not got["refused"], got
            assert got["job"].startswith("torchrun/") and got["absent"] == [], got
            assert got["peers"] == {str(1 - node): ["127.0.0.1", ports[1 - node]]}, got
