"""The DDP job of tests/system/test_ddp_epochs.py on two SLURM nodes: 8 ranks, node scope.

``scripts/slurm-local --nodes 2`` (the fixtures of tests/system/test_slurm_nodes.py): two
nodes in their own namespaces, each with its own local disk; ``srun -N 2
--ntasks-per-node=4`` starts tests/support/ddp_epoch_job.py as 8 tasks, which take their
rank and world size from ``SLURM_PROCID`` / ``SLURM_NTASKS`` and meet (gloo, 60 s collective
timeout) at rank 0's address on the nodes' bridge. Each rank reads a ``ResumableDataset``
with 2 DataLoader workers (16 consumers) through its node's cache (``SHARDCACHE_SCOPE=node``
on the node's local disk), over shards of unequal sample counts on the S3 server, reached
through a proxy on the host's bridge address; the server counts the requests, and rank 0
marks the end of each epoch in its log (``--mark-epochs``).

Checked: every rank yields the same number of batches in every epoch, each epoch delivers
every sample once plus exactly the reported repeats, the second and third epochs make no
GET, and the first (with a sample index made ahead, ``shardcache index``) fetches each
shard once per node that reads it: only the node's own shards, the one split between the
nodes by both. Then ``shardcache warm --split dataset`` as one ``srun`` step on both nodes
fills each node's cache with what its ranks read, and the training that follows sends no
request at all.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

import pytest
from test_ddp_epochs import (
    JOB,
    SEED,
    UNEQUAL,
    all_keys,
    check_epoch,
    make_index,
    records,
    requests_by_epoch,
    shard_tars,
)
from test_slurm import PYTHON, VENV_BIN
from test_slurm_nodes import (
    NODES,
    NTASKS,
    PER_NODE,
    Cluster,
    cluster,  # noqa: F401  (a fixture)
    link,  # noqa: F401  (a fixture)
    local_cache,  # noqa: F401  (a fixture)
    node_env,
    srun_nodes,
)

from shardcache import ResumableDataset, ShardCache
from shardcache.testing import FaultProxy, S3Server

BUCKET = "slurm-epochs"
MARK_BUCKET = "slurm-epoch-marks"
WORKERS = 2
BATCH = 8
# The process group's timeout (rendezvous and collectives): 8 tasks import torch at once on
# 2 cores, which alone took 26 s of wall time here with other jobs running; a rank short of
# a batch still fails the job in a minute, well inside srun's own bound.
COLLECTIVE_TIMEOUT = 60
SPEC = f"s3://{BUCKET}/train-{{000000..{len(UNEQUAL) - 1:06d}}}.tar"

pytestmark = pytest.mark.timeout(300)  # a first cluster start counts against the first test


@pytest.fixture
def shards(s3: S3Server) -> dict[str, bytes]:
    """The unequal shards of tests/system/test_ddp_epochs.py in the (reset) S3 server."""
    tars = shard_tars(UNEQUAL)
    s3.put_objects(BUCKET, tars)
    s3.clear_requests()
    return tars


def tasks_env(
    cluster: Cluster,  # noqa: F811
    s3: S3Server,
    proxy: FaultProxy,
    cache: str,
) -> dict[str, str]:
    """The tasks' environment: node scope in ``cache`` (on each node's local disk), S3
    through the proxy, and rank 0's node address on the bridge as the rendezvous (the
    nodes' hostnames do not resolve, so gloo is told its interface too)."""
    return node_env(
        cluster,
        s3,
        proxy,
        SHARDCACHE_SCOPE="node",
        SHARDCACHE_DIR=cache,
        MASTER_ADDR=cluster.node("scnode1").addr,
        # Rank 0 listens there, on scnode1: below the node's ephemeral ports (32768-60999),
        # which its outgoing connections and gloo's own listeners take at random.
        MASTER_PORT=str(random.randrange(20000, 32768)),
        GLOO_SOCKET_IFNAME="eth0",  # the node's end of its veth pair
        OMP_NUM_THREADS="1",
    )


def run_training(
    root: Path, env: dict[str, str], *extra: str, epochs: int
) -> dict[int, dict[int, dict]]:
    """The DDP job as 8 ``srun`` tasks on both nodes, to its end; its per-rank records."""
    started = time.monotonic()
    args = [
        PYTHON,
        str(JOB),
        f"--spec={SPEC}",
        f"--cache={env['SHARDCACHE_DIR']}",
        f"--out={root / 'out'}",
        f"--workers={WORKERS}",
        f"--epochs={epochs}",
        f"--batch-size={BATCH}",
        f"--seed={SEED}",
        f"--timeout={COLLECTIVE_TIMEOUT}",
        *extra,
    ]
    srun_nodes(args, env, root)
    print(f"training: {epochs} epochs in {time.monotonic() - started:.1f} s")
    logged = records(root, NTASKS)
    assert [sorted(logged[rank]) for rank in range(NTASKS)] == [list(range(epochs))] * NTASKS
    for epoch in range(epochs):
        check_epoch(
            logged, epoch, all_keys(UNEQUAL), batch_size=BATCH, remainder="pad", workers=WORKERS
        )
    return logged


def node_shards(index: Path) -> list[list[str]]:
    """The shard keys each node's cache reads in every epoch (the dataset's split into
    one unit per node: ranks 4k..4k+3 share node k's cache)."""
    return [
        [
            url.rsplit("/", 1)[1]
            for url in ResumableDataset(
                SPEC, seed=SEED, index=str(index), rank=node, world_size=NODES
            ).cache_urls()
        ]
        for node in range(NODES)
    ]


def test_three_epochs_on_two_nodes(
    cluster: Cluster,  # noqa: F811
    tmp_path: Path,
    s3: S3Server,
    link: FaultProxy,  # noqa: F811
    local_cache: str,  # noqa: F811
    shards: dict[str, bytes],
) -> None:
    """8 ranks x 2 workers, 3 epochs at node scope, with an index made ahead: equal
    batches, every sample once plus the reported repeats, and no GET after the first
    epoch. The first epoch fetches each shard once per node that reads it: a node only
    its own share, the shard split between the nodes by both."""
    env = tasks_env(cluster, s3, link, local_cache)
    index = make_index(s3, tmp_path, SPEC, link.endpoint_url)
    s3.clear_requests()

    marks = f"--mark-epochs={link.endpoint_url}/{MARK_BUCKET}"
    run_training(tmp_path, env, f"--index={index}", marks, epochs=3)
    gets, methods = requests_by_epoch(s3, BUCKET, MARK_BUCKET)
    print(f"requests by epoch: {[dict(m) for m in methods]}")
    assert len(gets) == 4, "the job did not mark the end of each of its 3 epochs"
    first, second, third, after = gets
    expected = Counter(key for keys in node_shards(index) for key in keys)
    assert set(expected) == set(shards)
    assert expected.total() < NODES * len(shards)  # the nodes' shares, not all of it twice
    assert first == expected, (dict(first), dict(expected))
    assert not second, f"epoch 1 made GETs: {dict(second)}"
    assert not third, f"epoch 2 made GETs: {dict(third)}"
    assert not after


def test_warm_then_train_on_two_nodes(
    cluster: Cluster,  # noqa: F811
    tmp_path: Path,
    s3: S3Server,
    link: FaultProxy,  # noqa: F811
    local_cache: str,  # noqa: F811
    shards: dict[str, bytes],
) -> None:
    """``shardcache warm --split dataset`` as one ``srun`` step of the training layout
    (local rank 0 of each node warms what the node's 4 ranks read), then 2 epochs of
    training with the same index: no request reaches S3 while training."""
    env = tasks_env(cluster, s3, link, local_cache)
    index = make_index(s3, tmp_path, SPEC, link.endpoint_url)
    s3.clear_requests()

    warm = [str(VENV_BIN / "shardcache"), "warm", SPEC, "--split", "dataset"]
    started = time.monotonic()
    out = srun_nodes([*warm, "--index", str(index), f"--seed={SEED}"], env, tmp_path)
    print(f"warm step: {time.monotonic() - started:.1f} s")
    wanted = node_shards(index)
    warm_gets = Counter(r.key for r in s3.requests("GET", f"/{BUCKET}/"))
    assert warm_gets == Counter(key for keys in wanted for key in keys), (dict(warm_gets), wanted)
    assert warm_gets.total() < NODES * len(shards)
    assert out.count("warm: nothing to do") == NODES * (PER_NODE - 1), out
    name = Path(local_cache).name
    options = s3.storage_options(link.endpoint_url)  # the cache key includes the endpoint
    for node, keys in zip(cluster.nodes, wanted, strict=True):
        cache = ShardCache(node.local / name, scope="node", storage_options=options)
        cached = {key for key in shards if cache.contains(f"s3://{BUCKET}/{key}")}
        assert cached == set(keys), node.name
    s3.clear_requests()

    run_training(tmp_path, env, f"--index={index}", epochs=2)
    training = s3.requests()
    print(f"warm GETs: {dict(warm_gets)}; training requests: {len(training)}")
    assert training == [], f"the training sent requests to S3: {training[:5]}"
