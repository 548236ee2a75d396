"""The cache mesh on four SLURM nodes: ``scripts/slurm-local --nodes 4``, each node its own
network namespace, address and local disk.

tests/support/ddp_epoch_job.py runs as one ``srun`` task a node (gloo at node 1's address, a
DDP step a batch), two DataLoader workers a task, node scope on the node's local disk,
``SHARDCACHE_MESH=1`` with a secret; the nodes meet in a shared directory
(``SHARDCACHE_RENDEZVOUS_DIR``: the nodes' names do not resolve here, so task 0's store
cannot be reached by name) and each serves on its own bridge address. The dataset has a lock
and ``shuffle_scope="global"``: epochs 1 and 2 deal the shards anew, so every node reads
shards another node's cache filled in epoch 0, from that node. The S3 server behind the
fault proxy counts the store's requests; each node's mesh server counts what it served.
"""

from __future__ import annotations

import json
import random
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pytest
from processes import COLLECTIVE_TIMEOUT, JOB_TIMEOUT, job_env
from tars import shard_samples
from test_ddp_epochs import (
    JOB,
    SEED,
    all_keys,
    check_epoch,
    make_index,
    records,
    requests_by_epoch,
    shard_tars,
    shardcache_cli,
)
from test_slurm import PYTHON, SETUP_TIMEOUT, run_job
from test_slurm_nodes import (
    Cluster,
    bring_up,
    link,  # noqa: F401  (a fixture)
    local_cache,  # noqa: F401  (a fixture)
    node_env,
)

from shardcache.testing import FaultProxy, S3Server

NODES = 4
WORKERS = 2
COUNTS = (6,) * 8  # 8 shards of 6 samples: 2 shards a node, 6 samples a consumer
BUCKET = "mesh-epochs"
MARK_BUCKET = "mesh-epoch-marks"
SPEC = f"s3://{BUCKET}/train-{{000000..{len(COUNTS) - 1:06d}}}.tar"
# The job's SLURM time limit, in minutes: beyond the test's own bound on it (JOB_TIMEOUT).
TIME_LIMIT = JOB_TIMEOUT // 60 + 2

pytestmark = pytest.mark.timeout(SETUP_TIMEOUT + JOB_TIMEOUT + 120)  # + the index and lock


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    """Four running SLURM nodes in their own namespaces (the link and the local cache of
    tests/system/test_slurm_nodes.py use them)."""
    return bring_up(NODES)


def srun_tasks(args: list[str], env: Mapping[str, str], cwd: Path) -> str:
    """``srun -N 4 --ntasks-per-node=1``, bounded by JOB_TIMEOUT (a hang's bound: the
    job fails by itself after COLLECTIVE_TIMEOUT at a collective); the tasks' stdout."""
    name = f"shardcache-test-{uuid.uuid4().hex[:12]}"
    cmd = [
        "srun",
        f"--nodes={NODES}",
        "--ntasks-per-node=1",
        f"--time={TIME_LIMIT}",
        f"--job-name={name}",
        "--kill-on-bad-exit=1",
        f"--chdir={cwd}",
        *args,
    ]
    return run_job(cmd, env, cwd, name, timeout=JOB_TIMEOUT)


def test_a_global_shuffle_reads_later_epochs_from_the_nodes_that_hold_the_shards(
    cluster: Cluster,
    tmp_path: Path,
    s3: S3Server,
    link: FaultProxy,  # noqa: F811
    local_cache: str,  # noqa: F811
) -> None:
    """Epoch 0: each node fills its own share from the store. Epoch 1: each node reads
    another node's share, and every one of those shards comes from that node's mesh
    server: the store sees one GET a shard in the whole job, all in epoch 0, and the
    servers together answer one transfer a shard. Every sample once an epoch."""
    s3.put_objects(BUCKET, shard_tars(COUNTS))
    index = make_index(s3, tmp_path, SPEC, link.endpoint_url)
    lock = tmp_path / "train.lock.json"
    shardcache_cli(
        (
            ["lock", SPEC, "-o", str(lock), "--cache-dir", str(tmp_path / "lock-cache")],
            job_env(**s3.env(link.endpoint_url)),
        )
    )
    s3.clear_requests()
    meet = tmp_path / "meet"
    meet.mkdir()
    env = node_env(
        cluster,
        s3,
        link,
        SHARDCACHE_SCOPE="node",
        SHARDCACHE_DIR=local_cache,
        SHARDCACHE_MESH="1",
        SHARDCACHE_MESH_SECRET="mesh-test-secret-" + uuid.uuid4().hex,
        SHARDCACHE_RENDEZVOUS_DIR=str(meet),
        SHARDCACHE_RENDEZVOUS_TIMEOUT=f"{COLLECTIVE_TIMEOUT}s",
        SHARDCACHE_MESH_TIMEOUT="60s",  # a live but starved peer still answers: GETs counted
        MASTER_ADDR=cluster.node("scnode1").addr,
        MASTER_PORT=str(random.randrange(20000, 40000)),
        GLOO_SOCKET_IFNAME="eth0",
        OMP_NUM_THREADS="1",
    )
    args = [
        PYTHON,
        str(JOB),
        f"--spec={SPEC}",
        f"--cache={local_cache}",
        f"--out={tmp_path / 'out'}",
        f"--workers={WORKERS}",
        "--epochs=3",
        "--batch-size=4",
        f"--seed={SEED}",
        f"--timeout={COLLECTIVE_TIMEOUT}",
        f"--index={index}",
        f"--lock={lock}",
        "--shuffle-scope=global",
        f"--mesh-addrs={','.join(node.addr for node in cluster.nodes)}",
        f"--mark-epochs={link.endpoint_url}/{MARK_BUCKET}",
    ]
    srun_tasks(args, env, tmp_path)

    logged = records(tmp_path, NODES)
    for epoch in (0, 1, 2):
        sizes = check_epoch(
            logged, epoch, all_keys(COUNTS), batch_size=4, remainder="pad", workers=WORKERS
        )
        assert sizes["repeated"] == 0
    gets, methods = requests_by_epoch(s3, BUCKET, MARK_BUCKET)
    print(f"store requests by epoch: {[dict(m) for m in methods]}")
    assert len(gets) == 4, "the job did not mark the end of each of its 3 epochs"
    shards = [f"train-{s:06d}.tar" for s in range(len(COUNTS))]
    assert gets[0] == Counter(shards), f"epoch 0's GETs: {dict(gets[0])}"
    assert not sum(gets[1:], Counter()), f"epochs 1-2 went to the store: {gets[1:]}"

    served = [
        json.loads((tmp_path / "out" / f"mesh-{rank}.json").read_text()) for rank in range(NODES)
    ]
    print(f"mesh servers: {served}")
    assert [s["node"] for s in served] == list(range(NODES))
    assert [s["peers"] for s in served] == [NODES - 1] * NODES  # every other node heard of
    # Each node served its home shards (epoch 0's) once to each node that read them later.
    owner = {key: s for s, n in enumerate(COUNTS) for key, _ in shard_samples(s, n)}
    read = [[{owner[k] for k in logged[n][e]["keys"]} for e in range(3)] for n in range(NODES)]
    home = {shard: n for n in range(NODES) for shard in read[n][0]}
    wanted = [0] * NODES
    for node in range(NODES):
        for shard in (read[node][1] | read[node][2]) - read[node][0]:
            wanted[home[shard]] += 1
    assert sum(wanted) > 0, read  # the deal moved shards
    assert [s["server"].get("200", 0) for s in served] == wanted, (served, read)
    for counts in served:
        assert set(counts["server"]) <= {"200", "bytes", "connections"}, counts
