"""A process joining the mesh when it makes its cache (SHARDCACHE_MESH=1), in this process,
meeting through a shared directory: local rank 0 serves and publishes its record, another
local rank or a node that serves nothing (upload rate 0) only reads; an unpickled copy never
joins; every reason the mesh cannot run is one warning, and the cache works without it."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
from processes import TOGETHER_TIMEOUT

from shardcache import ShardCache
from shardcache._mesh import node as mesh_node
from shardcache._mesh.secret import fingerprint


@pytest.fixture
def slurm_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This process as SLURM task 0, alone on node 0 of 1, the mesh on, meeting in a shared
    directory; a fresh process-wide membership (``join`` is once a process)."""
    monkeypatch.setattr(mesh_node, "_joined", {})
    shared = tmp_path / "shared"
    for name, value in {
        "SLURM_JOB_ID": "4302",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SHARDCACHE_MESH": "1",
        "SHARDCACHE_MESH_SECRET": "s" * 32,
        "SHARDCACHE_MESH_ADDR": "127.0.0.1",
        "SHARDCACHE_RENDEZVOUS_DIR": str(shared),
        "SHARDCACHE_RENDEZVOUS_TIMEOUT": "1s",
        "SHARDCACHE_MESH_MIN_RATE": "5M/s",
        "SHARDCACHE_MESH_TIMEOUT": "7s",
    }.items():
        monkeypatch.setenv(name, value)
    return shared


def test_local_rank_0_serves_and_publishes_its_record(slurm_node: Path, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", scope="node")
    mesh = cache.mesh
    assert mesh is not None and mesh.server is not None
    try:
        assert ShardCache(tmp_path / "cache", scope="node").mesh is mesh  # once a process
        record = json.loads((slurm_node / "4302" / "mesh" / "0.json").read_text())
        assert record["host"] == "127.0.0.1" and record["port"] == mesh.server.port
        assert record["node"] == 0 and record["fingerprint"] == fingerprint(b"s" * 32)
        assert mesh.membership.wait(TOGETHER_TIMEOUT) and mesh.membership.peers() == {}
        assert mesh.membership.own_node == 0 and mesh.membership.job_key.job == "4302"
        assert pickle.loads(pickle.dumps(cache)).mesh is None  # a worker's copy never serves
        assert (mesh.bounds.min_rate, mesh.bounds.timeout) == (5_000_000, 7.0)  # for the fetches
    finally:
        mesh.server.stop()


@pytest.mark.parametrize(
    ("name", "value"), [("SLURM_LOCALID", "1"), ("SHARDCACHE_MESH_UPLOAD_RATE", "0")]
)
def test_another_local_rank_or_a_node_serving_nothing_only_reads(
    slurm_node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    mesh = ShardCache(tmp_path / "cache", scope="node").mesh
    assert mesh is not None and mesh.server is None and mesh.membership.wait(TOGETHER_TIMEOUT)
    assert not list(slurm_node.rglob("*.json"))  # nothing published


@pytest.mark.parametrize(
    ("cause", "said"),
    [
        ("SHARDCACHE_MESH_ADDR", "set SHARDCACHE_MESH_ADDR"),
        ("SLURM_STEP_NUM_NODES", "no node count"),
        ("SLURM_JOB_ID", "no meeting point"),
        ("not an address of this node", "cannot listen on 203.0.113.9"),
    ],
)
def test_a_mesh_that_cannot_run_is_one_warning_and_the_cache_works(
    slurm_node: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cause: str,
    said: str,
) -> None:
    if cause.startswith(("SHARDCACHE_", "SLURM_")):  # a variable unset
        monkeypatch.delenv(cause)
    else:  # TEST-NET-3: an address no interface of this machine holds
        monkeypatch.setenv("SHARDCACHE_MESH_ADDR", "203.0.113.9")
    if cause == "SLURM_JOB_ID":
        monkeypatch.delenv("SHARDCACHE_RENDEZVOUS_DIR")
    local = tmp_path / "local.tar"
    local.write_bytes(b"x" * 100)
    with caplog.at_level(logging.WARNING, logger="shardcache.mesh"):
        cache = ShardCache(tmp_path / "cache", scope="node")
        ShardCache(tmp_path / "cache", scope="node")
    assert cache.mesh is None and cache.fetch(str(local)).read_bytes() == b"x" * 100
    [warning] = [r.getMessage() for r in caplog.records]
    assert "the cache mesh stays off" in warning and said in warning
