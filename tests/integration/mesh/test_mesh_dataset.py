"""A dataset in the cache mesh, with real processes as the nodes of a two-node job on
127.0.0.1 (SLURM's variables, one task a node, meeting in a shared directory), each with its
own cache root (its "local disk") and a DataLoader worker: a dataset with a lock offers its
shards to the node's server and gives its cache the holders of the job's hand-out. With
``shuffle_scope="global"`` epoch 1 deals the shards anew, so each node reads shards of the
other's home share (epoch 0's deal): those misses are filled by the other node's server, not
the store (the store's side counts GETs at the fault proxy, each server its transfers), the
DataLoader worker fetching them, and land marked least recently used. At node scope
(cache *i* on node *i*) a ``MixtureDataset`` of two sources with a lock each, through one
cache; through a second cache of the same processes, at rank scope (rank *r*'s scope
directory on rank *r*'s node), a ``ResumableDataset`` of the first source."""

from __future__ import annotations

import os
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from processes import TOGETHER_TIMEOUT, collect
from tars import shard_samples, tar_bytes

from shardcache._cli.main import main as shardcache_main
from tools.processes import CTX

BUCKET = "meshdataset"
NODES, SHARDS, SAMPLES = 2, 4, 5  # shards a source
SOURCES = ("a", "b")  # source a: shards 0..3, b: shards 4..7
SCOPES = ("node", "rank")
SECRET = "c" * 32
pytestmark = pytest.mark.timeout(TOGETHER_TIMEOUT)
COUNTED = ("misses", "from_peers", "peer_fallbacks")  # a node's loader report, an epoch


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
        "SHARDCACHE_RENDEZVOUS_TIMEOUT": f"{TOGETHER_TIMEOUT}s",  # a hang's bound only
        "SHARDCACHE_MESH_TIMEOUT": "60s",  # a live but starved peer still answers: GETs counted
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
    """Two epochs of the mixture at node scope and of source ``a`` at rank scope, each
    through a DataLoader worker, the nodes in step between epochs; then this node's server's
    counts (one server serves both scopes)."""
    import logging

    import torch.utils.data

    import shardcache

    log = logging.FileHandler(Path(job["root"]).with_suffix(".log"))  # DataLoader workers too
    log.setFormatter(logging.Formatter("%(process)d %(name)s %(levelname)s %(message)s"))
    logging.getLogger("shardcache").addHandler(log)
    logging.getLogger("shardcache").setLevel(logging.DEBUG)
    caches = {scope: shardcache.ShardCache(job["root"], scope=scope) for scope in SCOPES}
    sources = [
        shardcache.Source(
            job[name]["spec"], samples=SHARDS * SAMPLES, name=name, **job[name]["made"]
        )
        for name in SOURCES
    ]
    mixture = shardcache.MixtureDataset(sources, cache=caches["node"], shuffle_scope="global")
    alone = shardcache.ResumableDataset(
        job["a"]["spec"], cache=caches["rank"], shuffle_scope="global", **job["a"]["made"]
    )
    datasets = {"node": mixture, "rank": alone}
    keys: dict[str, list[list[str]]] = {scope: [] for scope in SCOPES}
    counted = []
    for epoch in range(2):
        for scope, dataset in datasets.items():
            dataset.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
            keys[scope].append([sample["__key__"] for sample in loader])
        report = shardcache.log_epoch_summary(epoch)
        counted.append({name: report[name] for name in COUNTED})
        barrier.wait()  # every node's epoch is over (a node failing aborts the barrier)
    mesh = caches["node"].mesh
    assert mesh is not None and mesh.server is not None and caches["rank"].mesh is mesh
    assert mesh.server.wait_idle(TOGETHER_TIMEOUT)
    stamps = {
        scope: {_name(e.url): e.last_used for e in caches[scope].entries()} for scope in SCOPES
    }
    evicted = {}  # down to the home share (epoch 0's shards): what eviction takes first
    for scope in SCOPES:
        home = _shards_read(keys[scope][0])
        entries = caches[scope].entries()
        report = caches[scope].evict(sum(e.size for e in entries if _name(e.url) in home))
        evicted[scope] = sorted(_name(e.url) for e in report.removed)
    counts = mesh.server.counts()
    return {
        "node": me,
        "keys": keys,
        "counts": counts,
        "counted": counted,
        "stamps": stamps,
        "evicted": evicted,
    }


def _name(url: str | None) -> str:
    return str(url).rsplit("/", 1)[-1]


def _shards_read(keys: list[str]) -> set[str]:
    """The shards (file names) whose samples ``keys`` are."""
    owner = {key: s for s in range(2 * SHARDS) for key, _ in shard_samples(s, SAMPLES)}
    return {f"train-{owner[key]}.tar" for key in keys}


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
        results = collect(out, procs, NODES)  # as long as the nodes live
        for proc in procs:
            proc.join()
    finally:
        barrier.abort()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert not [r["error"] for r in results if "error" in r]
    return sorted(results, key=lambda r: r["node"])


@pytest.fixture
def job(s3, fault_proxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Each source's shards in the store, and its sample index and dataset lock made
    through the proxy."""
    tars = {f"train-{s}.tar": tar_bytes(shard_samples(s, SAMPLES)) for s in range(2 * SHARDS)}
    s3.put_objects(BUCKET, tars)
    for name, value in s3.env(fault_proxy.endpoint_url).items():
        monkeypatch.setenv(name, value)
    made: dict[str, Any] = {}
    for at, name in enumerate(SOURCES):
        first = at * SHARDS
        spec = f"s3://{BUCKET}/train-{{{first}..{first + SHARDS - 1}}}.tar"
        files = {"index": str(tmp_path / f"{name}.index"), "lock": str(tmp_path / f"{name}.lock")}
        cache = ["--cache-dir", str(tmp_path / "cli-cache")]
        assert shardcache_main(["index", spec, "-o", files["index"], *cache]) == 0
        assert shardcache_main(["lock", spec, "-o", files["lock"], *cache]) == 0
        made[name] = {"spec": spec, "made": files}
    return made


def _gets(fault_proxy) -> Counter[str]:
    return Counter(
        {path: n for (method, path), n in fault_proxy.requests_seen().items() if method == "GET"}
    )


def test_a_global_shuffle_reads_other_nodes_home_shards_from_their_servers(
    job, s3, fault_proxy, tmp_path: Path
) -> None:
    before = _gets(fault_proxy)  # the index's reads
    results = run_nodes(tmp_path, s3.env(fault_proxy.endpoint_url), job)

    every = {
        "node": sorted(key for s in range(2 * SHARDS) for key, _ in shard_samples(s, SAMPLES)),
        "rank": sorted(key for s in range(SHARDS) for key, _ in shard_samples(s, SAMPLES)),
    }
    served_by = [0] * NODES  # what each node's server must have sent: the visitors it homes
    moved = [0] * NODES  # what each node's loader took from the other in epoch 1
    for scope in SCOPES:
        home = [_shards_read(r["keys"][scope][0]) for r in results]  # epoch 0's deal
        for epoch in (0, 1):
            assert sorted(k for r in results for k in r["keys"][scope][epoch]) == every[scope]
        for me, result in enumerate(results):
            visitors = _shards_read(result["keys"][scope][1]) - home[me]
            assert visitors, (scope, me)  # the deal moved shards between the nodes
            served_by[1 - me] += len(visitors)
            moved[me] += len(visitors)
            stamps = result["stamps"][scope]  # visitors least recently used, home shards not
            assert {name for name, used in stamps.items() if used < 2} == visitors, stamps
            assert set(stamps) == home[me] | visitors
            assert result["evicted"][scope] == sorted(visitors)  # and no home shard
    # Each node's loader: epoch 0 misses its 4 node-scope and 2 rank-scope shards, epoch 1
    # takes every shard the deal moved to it from the other node, no peer failing (a GET too
    # many would say why here).
    epochs = [
        [
            {"misses": 6, "from_peers": 0, "peer_fallbacks": 0},
            {"misses": 0, "from_peers": moved[me], "peer_fallbacks": 0},
        ]
        for me in range(NODES)
    ]
    gets = _gets(fault_proxy) - before  # each shard once into each cache reading it, epoch 0
    twice = {f"/{BUCKET}/train-{s}.tar": 2 for s in range(SHARDS)}  # source a: both scopes
    once = {f"/{BUCKET}/train-{s}.tar": 1 for s in range(SHARDS, 2 * SHARDS)}
    served = [r["counts"] for r in results]  # the servers' own counts
    seen = {"reports": [r["counted"] for r in results], "gets": gets, "served": served}
    logs = "\n".join(_peer_lines(tmp_path / f"node-{n}.log") for n in range(NODES))
    print(f"{seen}\n{logs}")  # shown with a failure, whole
    assert seen["reports"] == epochs, (seen, logs)
    assert gets == Counter(twice | once), (seen, logs)
    assert [c.get("200", 0) for c in served] == served_by, (seen, logs)
    assert all(set(c) <= {"200", "bytes", "connections"} for c in served), served


def _peer_lines(log: Path) -> str:
    """The lines of a node's log (its DataLoader workers' too) about peers, for a failure."""
    lines = log.read_text().splitlines() if log.exists() else []
    return "\n".join(f"{log.stem}: {line}" for line in lines if "peer" in line.lower())
