"""A dataset in the cache mesh, with real processes as the nodes of a two-node job on
127.0.0.1 (SLURM's variables, one task a node, meeting in a shared directory), each with its
own cache root (its "local disk") and a DataLoader worker: ``ResumableDataset`` with a lock
offers its shards to the node's server and gives its cache the holders of the job's
hand-out. The split's internal rotation makes each node read the other's share in epoch 1:
those misses are filled by the other node's server, not the store (the store's side counts
GETs at the fault proxy, each server its transfers), the DataLoader worker fetching them;
at node scope (cache *i* on node *i*) and, through a second cache of the same processes, at
rank scope (rank *r*'s scope directory on rank *r*'s node)."""

from __future__ import annotations

import os
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from processes import CTX
from tars import shard_samples, tar_bytes

from shardcache._cli.main import main as shardcache_main

BUCKET = "meshdataset"
NODES, SHARDS, SAMPLES = 2, 4, 5
SCOPES = ("node", "rank")
SECRET = "c" * 32
pytestmark = pytest.mark.timeout(180)


def node_env(node: int, meet: Path, s3_env: dict[str, str]) -> dict[str, str]:
    return {
        **s3_env,
        "SLURM_JOB_ID": "4302",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(NODES),
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_STEP_NUM_NODES": str(NODES),
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SHARDCACHE_MESH": "1",
        "SHARDCACHE_MESH_SECRET": SECRET,
        "SHARDCACHE_MESH_ADDR": "127.0.0.1",
        "SHARDCACHE_RENDEZVOUS_DIR": str(meet),
        "SHARDCACHE_RENDEZVOUS_TIMEOUT": "30s",
    }


def node_process(env: dict[str, str], job: dict[str, Any], barrier: Any, out: Any) -> None:
    os.environ.update(env)
    me = int(env["SLURM_NODEID"])
    try:
        out.put(node(me, job, barrier))
    except BaseException:
        barrier.abort()
        out.put({"node": me, "error": traceback.format_exc()})


def node(me: int, job: dict[str, Any], barrier: Any) -> dict[str, Any]:
    """Two epochs of the dataset at node scope and of the same shards through a rank-scope
    cache, each through a DataLoader worker, the nodes in step between epochs; then this
    node's server's counts (one server serves both scopes)."""
    import torch.utils.data

    import shardcache

    caches = {scope: shardcache.ShardCache(job["root"], scope=scope) for scope in SCOPES}
    datasets = {
        scope: shardcache.ResumableDataset(
            job["spec"], index=job["index"], lock=job["lock"], cache=cache
        )
        for scope, cache in caches.items()
    }
    keys: dict[str, list[list[str]]] = {scope: [] for scope in SCOPES}
    for epoch in range(2):
        for scope, dataset in datasets.items():
            dataset._rotate_units = True  # internal: epoch 1 reads the other node's share
            dataset.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
            keys[scope].append([sample["__key__"] for sample in loader])
        barrier.wait(60)  # every node's epoch is over: its shards are published
    mesh = caches["node"].mesh
    assert mesh is not None and mesh.server is not None and caches["rank"].mesh is mesh
    assert mesh.server.wait_idle(10)
    return {"node": me, "keys": keys, "counts": mesh.server.counts()}


def run_nodes(tmp_path: Path, s3_env: dict[str, str], job: dict[str, Any]) -> list[dict]:
    barrier, out = CTX.Barrier(NODES), CTX.Queue()
    procs = []
    for n in range(NODES):
        env = node_env(n, tmp_path / "meet", s3_env)
        node_job = {**job, "root": str(tmp_path / f"node-{n}")}
        procs.append(CTX.Process(target=node_process, args=(env, node_job, barrier, out)))
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=150) for _ in range(NODES)]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert not [r["error"] for r in results if "error" in r]
    return sorted(results, key=lambda r: r["node"])


@pytest.fixture
def job(s3, fault_proxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The shards in the store, a sample index and a dataset lock made through the proxy."""
    tars = {f"train-{s}.tar": tar_bytes(shard_samples(s, SAMPLES)) for s in range(SHARDS)}
    s3.put_objects(BUCKET, tars)
    spec = f"s3://{BUCKET}/train-{{0..{SHARDS - 1}}}.tar"
    for name, value in s3.env(fault_proxy.endpoint_url).items():
        monkeypatch.setenv(name, value)
    made = {"spec": spec, "index": str(tmp_path / "index.json"), "lock": str(tmp_path / "lock")}
    cache = ["--cache-dir", str(tmp_path / "cli-cache")]
    assert shardcache_main(["index", spec, "-o", made["index"], *cache]) == 0
    assert shardcache_main(["lock", spec, "-o", made["lock"], *cache]) == 0
    return made


def _gets(fault_proxy) -> Counter[str]:
    return Counter(
        {path: n for (method, path), n in fault_proxy.requests_seen().items() if method == "GET"}
    )


def test_epoch_one_reads_the_other_nodes_share_from_its_server(
    job, s3, fault_proxy, tmp_path: Path
) -> None:
    before = _gets(fault_proxy)  # the index's reads
    results = run_nodes(tmp_path, s3.env(fault_proxy.endpoint_url), job)

    every = sorted(key for s in range(SHARDS) for key, _ in shard_samples(s, SAMPLES))
    for scope in SCOPES:
        for epoch in (0, 1):
            assert sorted(k for r in results for k in r["keys"][scope][epoch]) == every
        assert set(results[0]["keys"][scope][0]) == set(results[1]["keys"][scope][1])  # swapped
    gets = _gets(fault_proxy) - before  # each shard once into each scope's cache, epoch 0
    assert gets == Counter({f"/{BUCKET}/train-{s}.tar": 2 for s in range(SHARDS)}), gets
    served = [r["counts"] for r in results]  # the servers' own counts: a node's two shares
    assert [c.get("200", 0) for c in served] == [len(SCOPES) * SHARDS // NODES] * NODES, served
    assert all(set(c) <= {"200", "bytes", "connections"} for c in served), served
