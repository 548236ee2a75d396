"""shardcache on a SLURM cluster of several nodes: ``scripts/slurm-local --nodes 2``.

Each node is a network, UTS and mount namespace of its own (hostname ``scnodeK``, an
address on a bridge, a node-local disk at the same path on every node), with its own
``slurmd``; ``srun -N 2`` places tasks on both. The S3 server listens on 127.0.0.1 as in
every test; a fault proxy on the host's bridge address is the nodes' way to it, and the
server counts the requests. Skipped, like the one-node SLURM tests, only when the script
cannot bring the nodes up, and a failure under ``SHARDCACHE_REQUIRE_SLURM=1`` (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_slurm import (
    EMIT,
    PYTHON,
    SETUP_TIMEOUT,
    SLURM_LOCAL,
    SPEC,
    TRAIN_CHECK,
    VENV_BIN,
    check_all_hits,
    data,  # noqa: F401  (a fixture)
    gets_per_shard,
    run_job,
    sha256,
    submit_template,
    task_env,
    task_records,
)

from shardcache import ShardCache
from shardcache.testing import FaultProxy, S3Server

NODES = 2
PER_NODE = 4
NTASKS = NODES * PER_NODE

pytestmark = pytest.mark.timeout(SETUP_TIMEOUT + 240)


@dataclass(frozen=True)
class Node:
    name: str
    addr: str
    net: str  # network namespace file
    mnt: str  # mount namespace file
    uts: str
    local: Path  # the host's view of the node's local disk


@dataclass(frozen=True)
class Cluster:
    slurm_conf: str
    local_disk: Path  # the node-local disk's path, as every node sees it
    host_addr: str  # the host's address on the nodes' bridge
    nodes: tuple[Node, ...]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


def parse_report(stdout: str) -> Cluster:
    """The cluster from ``scripts/slurm-local --nodes``' ``KEY=value`` lines."""
    top: dict[str, str] = {}
    nodes = []
    for line in stdout.splitlines():
        if line.startswith("NODE="):
            fields = dict(f.split("=", 1) for f in line.split())
            nodes.append(
                Node(
                    fields["NODE"],
                    fields["addr"],
                    fields["net"],
                    fields["mnt"],
                    fields["uts"],
                    Path(fields["local"]),
                )
            )
        elif "=" in line:
            key, value = line.split("=", 1)
            top[key] = value
    return Cluster(top["SLURM_CONF"], Path(top["LOCAL_DISK"]), top["HOST_ADDR"], tuple(nodes))


def slurm_local(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SLURM_LOCAL), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SETUP_TIMEOUT,
        check=False,
    )


def bring_up(nodes: int) -> Cluster:
    """``nodes`` running SLURM nodes in their own namespaces (another count's taken down
    first); skipped when they cannot be brought up, failed under SHARDCACHE_REQUIRE_SLURM=1."""
    required = os.environ.get("SHARDCACHE_REQUIRE_SLURM") == "1"
    unavailable = pytest.fail if required else pytest.skip
    if shutil.which("bash") is None:
        unavailable("the multi-node SLURM tests need bash to run scripts/slurm-local")
    try:
        proc = slurm_local("--nodes", str(nodes))
    except subprocess.TimeoutExpired as exc:
        unavailable(
            f"scripts/slurm-local --nodes {nodes} did not finish in {SETUP_TIMEOUT}s: {exc}"
        )
    if proc.returncode != 0:
        root = "" if os.geteuid() == 0 else "needs root (namespaces, SLURM): "
        unavailable(
            f"{root}scripts/slurm-local --nodes {nodes} exited {proc.returncode}:\n"
            f"{proc.stdout}{proc.stderr}"
        )
    return parse_report(proc.stdout)


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    """Two running SLURM nodes in their own namespaces."""
    return bring_up(NODES)


@pytest.fixture
def link(cluster: Cluster, s3: S3Server) -> Iterator[FaultProxy]:
    """The nodes' way to the S3 server: a proxy on the host's bridge address."""
    with FaultProxy("127.0.0.1", s3.port, host=cluster.host_addr) as proxy:
        yield proxy


@pytest.fixture
def local_cache(cluster: Cluster) -> Iterator[str]:
    """A fresh cache directory on every node's local disk (the same path on each)."""
    name = f"cache-{uuid.uuid4().hex[:8]}"
    yield str(cluster.local_disk / name)
    for node in cluster.nodes:
        shutil.rmtree(node.local / name, ignore_errors=True)


def node_env(
    cluster: Cluster, s3: S3Server | None = None, proxy: FaultProxy | None = None, **extra: str
) -> dict[str, str]:
    env = task_env(None, SLURM_CONF=cluster.slurm_conf, **extra)
    if s3 is not None and proxy is not None:
        env.update(s3.env(proxy.endpoint_url))
    return env


def srun_nodes(args: list[str], env: Mapping[str, str], cwd: Path) -> str:
    """``srun -N 2 --ntasks-per-node=4`` on the nodes' cluster; returns the tasks' stdout."""
    name = f"shardcache-test-{uuid.uuid4().hex[:12]}"
    cmd = [
        "srun",
        f"--nodes={NODES}",
        f"--ntasks-per-node={PER_NODE}",
        "--time=2",
        f"--job-name={name}",
        "--kill-on-bad-exit=1",
        f"--chdir={cwd}",
        *args,
    ]
    return run_job(cmd, env, cwd, name)


def task(code: str) -> list[str]:
    """srun arguments running ``code`` in the venv's python (``emit`` defined)."""
    prelude = "import hashlib, socket, sys\nfrom shardcache import ShardCache\n"
    return [PYTHON, "-c", EMIT + prelude + code]


# ---------------------------------------------------------------------------- tests
def test_srun_spans_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    """``srun -N 2 -n 8 hostname``: four tasks on each node, each with its own hostname."""
    name = f"shardcache-test-{uuid.uuid4().hex[:12]}"
    env = node_env(cluster)
    cmd = ["srun", "-N", "2", "-n", "8", f"--job-name={name}", "--time=1", "hostname"]
    out = run_job(cmd, env, tmp_path, name)
    assert sorted(out.split()) == ["scnode1"] * 4 + ["scnode2"] * 4


def test_rank_layout_and_split_by_node(cluster: Cluster, tmp_path: Path) -> None:
    """Ranks, local ranks and node ranks from SLURM, and ``split_by_node`` shares that are
    disjoint and together complete across both nodes."""
    code = (
        "import os\n"
        "from dataclasses import asdict\n"
        "import shardcache\n"
        "from shardcache.distributed import rank_info\n"
        "share = list(shardcache.split_by_node(iter(range(50))))\n"
        "info = asdict(rank_info())\n"
        "emit(rank=info['rank'], info=info, host=socket.gethostname(), share=share,\n"
        "     env={k: os.environ[k] for k in ('SLURM_NODEID', 'SLURM_LOCALID',\n"
        "          'SLURM_PROCID', 'SLURM_TASKS_PER_NODE', 'SLURMD_NODENAME')})\n"
    )
    records = task_records(srun_nodes(task(code), node_env(cluster), tmp_path), NTASKS)

    shares: list[int] = []
    for rank, r in enumerate(records):
        node = rank // PER_NODE
        assert r["host"] == r["env"]["SLURMD_NODENAME"] == f"scnode{node + 1}"
        assert r["env"]["SLURM_NODEID"] == str(node)
        assert r["env"]["SLURM_TASKS_PER_NODE"] == f"{PER_NODE}(x{NODES})"
        assert r["info"] == {
            "rank": rank,
            "local_rank": rank % PER_NODE,
            "world_size": NTASKS,
            "local_world_size": PER_NODE,
            "node_rank": node,
            "job_id": r["info"]["job_id"],
            "source": "slurm",
        }
        assert r["share"] == list(range(rank, 50, NTASKS))
        shares += r["share"]
    assert sorted(shares) == list(range(50)), "shares overlap or miss items"
    assert len({r["info"]["job_id"] for r in records}) == 1


@pytest.mark.parametrize(("scope", "gets_each"), [("node", NODES), ("rank", NTASKS)])
def test_every_rank_reads_everything(
    cluster: Cluster,
    tmp_path: Path,
    s3: S3Server,
    link: FaultProxy,
    data: dict[str, bytes],  # noqa: F811
    local_cache: str,
    scope: str,
    gets_each: int,
) -> None:
    """8 ranks on 2 nodes each fetch all 12 shards into the node-local disk.

    Node scope: one cache per node, so each shard is downloaded once per node (2 GETs per
    shard); rank scope: once per rank (8). The bytes are right everywhere, and each node's
    copies are on its own disk, not visible to the other node.
    """
    code = (
        "import json\n"
        "urls = sys.argv[2:]\n"
        "cache = ShardCache(cache_dir=sys.argv[1])\n"
        "r = cache.settings.rank\n"
        "order = urls[r * 3 % len(urls):] + urls[:r * 3 % len(urls)]\n"
        "digests = {u: hashlib.sha256(cache.fetch(u).read_bytes()).hexdigest() for u in order}\n"
        "digest = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()\n"
        "emit(rank=r, host=socket.gethostname(), scope_dir=str(cache.settings.scope_dir),\n"
        "     digest=digest, misses=cache.stats().misses)\n"
    )
    env = node_env(cluster, s3, link, SHARDCACHE_SCOPE=scope)
    records = task_records(srun_nodes([*task(code), local_cache, *data], env, tmp_path), NTASKS)

    expected = {url: sha256(body) for url, body in data.items()}
    expected_digest = sha256(json.dumps(expected, sort_keys=True).encode())
    assert all(r["digest"] == expected_digest for r in records)
    assert gets_per_shard(s3) == dict.fromkeys(gets_per_shard(s3), gets_each)
    name = Path(local_cache).name
    options = s3.storage_options(link.endpoint_url)  # the cache key includes the endpoint
    for k, node in enumerate(cluster.nodes):
        on_node = [r for r in records if r["host"] == node.name]
        assert len(on_node) == PER_NODE
        dirs = sorted(p.name for p in (node.local / name).iterdir())
        if scope == "node":
            assert dirs == ["node"]
            assert sum(r["misses"] for r in on_node) == len(data)
            caches = [ShardCache(node.local / name, scope="node", storage_options=options)]
        else:
            ranks = range(k * PER_NODE, (k + 1) * PER_NODE)
            assert dirs == [f"rank-{r}" for r in ranks]
            assert [r["misses"] for r in on_node] == [len(data)] * PER_NODE
            caches = [
                ShardCache(node.local / name, scope="rank", rank=r, storage_options=options)
                for r in ranks
            ]
        for cache in caches:
            for url, body in data.items():
                assert cache.path_for(url).read_bytes() == body
    assert not (cluster.local_disk / name).exists(), "the host sees a node's local disk"


def test_warm_split_auto_per_node_then_train_all_hits(
    cluster: Cluster,
    tmp_path: Path,
    s3: S3Server,
    link: FaultProxy,
    data: dict[str, bytes],  # noqa: F811
    local_cache: str,
) -> None:
    """``shardcache warm --split auto`` with node scope on both nodes (the training
    layout), then a training step reading each rank's ``split_by_node`` share: every read
    a hit, and no request at all reaches S3 in the training step."""
    env = node_env(cluster, s3, link, SHARDCACHE_SCOPE="node", SHARDCACHE_DIR=local_cache)
    warm = [str(VENV_BIN / "shardcache"), "warm", SPEC, "--split", "auto"]
    srun_nodes(warm, env, tmp_path)

    assert gets_per_shard(s3) == dict.fromkeys(gets_per_shard(s3), 1)
    urls = list(data)
    name = Path(local_cache).name
    for k, node in enumerate(cluster.nodes):
        ranks = range(k * PER_NODE, (k + 1) * PER_NODE)
        wanted = {u for r in ranks for u in urls[r::NTASKS]}
        options = s3.storage_options(link.endpoint_url)
        cache = ShardCache(node.local / name, scope="node", storage_options=options)
        assert {u for u in urls if cache.contains(u)} == wanted, node.name
    s3.clear_requests()

    train = tmp_path / "train_check.py"
    train.write_text(TRAIN_CHECK)
    records = task_records(
        srun_nodes([PYTHON, str(train)], {**env, "SHARDS": SPEC}, tmp_path), NTASKS
    )
    check_all_hits(records, f"{local_cache}/node", data, log="")
    assert s3.requests() == [], "the training step sent requests to S3"


def test_sbatch_template_on_two_nodes(
    cluster: Cluster,
    tmp_path: Path,
    s3: S3Server,
    link: FaultProxy,
    data: dict[str, bytes],  # noqa: F811
    local_cache: str,
) -> None:
    """The documented sbatch template, submitted with ``-N 2``: the warm step fills each
    node's local cache with its ranks' shares, the training step reads only hits."""
    env = node_env(cluster, s3, link, SHARDS=SPEC, SHARDCACHE_DIR=local_cache)
    log, records = submit_template(tmp_path, env, nodes=NODES, per_node=PER_NODE)
    assert f"{NODES} node(s), {NTASKS} tasks" in log
    assert {r["master"] for r in records} == {"scnode1"}
    check_all_hits(records, f"{local_cache}/node", data, log)
    assert gets_per_shard(s3) == dict.fromkeys(gets_per_shard(s3), 1)


def test_down_removes_everything_and_up_again(cluster: Cluster) -> None:
    """``--down`` leaves no daemon, namespace, interface or mount; ``--nodes 2`` after it
    brings the same cluster back (the last test of the module)."""
    down = slurm_local("--down")
    assert down.returncode == 0, down.stderr
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert not [ln for ln in netns.stdout.splitlines() if ln.startswith("scnode")]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True)
    assert not [ln for ln in links.stdout.splitlines() if ln.startswith(("scbr0", "scveth"))]
    state_dir = str(Path(cluster.slurm_conf).parent)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert state_dir not in mounts and str(cluster.local_disk) not in mounts
    pids = subprocess.run(
        ["pgrep", "-f", cluster.slurm_conf], capture_output=True, text=True, check=False
    )
    assert pids.stdout.strip() == "", f"daemons left: {pids.stdout}"

    up = slurm_local("--nodes", str(NODES))
    assert up.returncode == 0, up.stderr
    assert parse_report(up.stdout) == cluster
