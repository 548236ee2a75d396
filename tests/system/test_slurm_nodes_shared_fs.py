"""A cache shared by the nodes on a real network file system: one JuiceFS volume, mounted
once inside each node of ``scripts/slurm-local --nodes 2`` (each mount a FUSE client with
its own attribute and entry caches, at their defaults), and once in the host to watch.

Lease locks are what the nodes coordinate with (``lock_mode=auto`` takes them on
``fuse.juicefs``); the node-local lock in front of the lease lives on each node's own
local disk. Crashes are real ``SIGKILL``s of a node's downloader. A skewed clock is the
downloader's wall clock (Python's ``time.time``) moved by a day: no two namespaces of one
kernel can have different real-time clocks, and the lease records are written with that
clock.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mounts import require_fuse
from test_slurm import PYTHON, task_records
from test_slurm_nodes import (
    NTASKS,
    Cluster,
    Node,
    cluster,  # noqa: F401  (a fixture)
    link,  # noqa: F401  (a fixture)
    node_env,
    srun_nodes,
    task,
)

from shardcache.testing import FaultProxy, S3Server
from tools.juicefs import Mount, format_volume, mounted

BUCKET = "shared-fs"
LEASE_TIME = 4.0  # > the mounts' 1 s attribute cache + a renewal interval (1 s), with margin
WAIT_TIMEOUT = 60.0
DAY = 86_400.0

pytestmark = pytest.mark.timeout(300)


def node_prefix(node: Node) -> list[str]:
    return ["nsenter", f"--mount={node.mnt}", f"--uts={node.uts}", f"--net={node.net}", "--"]


@dataclass
class SharedFS:
    mountpoint: Path  # the same path in every node, each a mount of its own
    host: Mount  # the host's own mount of the volume (caches off), to watch from


@pytest.fixture(scope="module")
def shared_fs(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedFS]:  # noqa: F811
    """The volume mounted in both nodes (JuiceFS's default caches) and in the host."""
    require_fuse()
    base = tmp_path_factory.mktemp("jfs")
    volume = format_volume(base / "volume")
    mountpoint = base / "mnt"
    with (
        mounted(volume, mountpoint, prefix=node_prefix(cluster.nodes[0])),
        mounted(volume, mountpoint, prefix=node_prefix(cluster.nodes[1])),
        mounted(volume, base / "host", cache_seconds=0) as host,
    ):
        yield SharedFS(mountpoint, host)


@pytest.fixture
def cache_name(cluster: Cluster) -> Iterator[str]:  # noqa: F811
    """A fresh cache name on the shared volume (and for the node locks on local disks)."""
    name = f"cache-{uuid.uuid4().hex[:8]}"
    yield name
    for node in cluster.nodes:
        shutil.rmtree(node.local / f"node-locks-{name}", ignore_errors=True)


def shared_env(
    cluster: Cluster,  # noqa: F811
    s3: S3Server,
    proxy: FaultProxy,
    cache_name: str,
    **extra: str,
) -> dict[str, str]:
    """Scope "node" on the shared volume: one cache for the whole cluster; node locks on
    each node's local disk (the host's /tmp is shared by these nodes, a real node's not)."""
    return node_env(
        cluster,
        s3,
        proxy,
        SHARDCACHE_SCOPE="node",
        SHARDCACHE_NODE_LOCK_DIR=str(cluster.local_disk / f"node-locks-{cache_name}"),
        SHARDCACHE_LEASE_TIME=f"{LEASE_TIME:g}s",
        **extra,
    )


def test_each_shard_downloaded_once_cluster_wide(
    cluster: Cluster,  # noqa: F811
    shared_fs: SharedFS,
    s3: S3Server,
    link: FaultProxy,  # noqa: F811
    tmp_path: Path,
    cache_name: str,
) -> None:
    """8 ranks on 2 nodes all read all 16 shards, each starting elsewhere, through one
    cache on the network file system: every shard is downloaded once in the cluster, the
    locks are leases, and every rank reads every byte right."""
    objects = {f"train-{i:06d}.tar": os.urandom(200_000 + 5_000 * i) for i in range(16)}
    s3.put_objects(BUCKET, objects)
    s3.clear_requests()
    urls = [f"s3://{BUCKET}/{key}" for key in objects]
    code = (
        "import json\n"
        "urls = sys.argv[2:]\n"
        "cache = ShardCache(cache_dir=sys.argv[1])\n"
        "r = cache.settings.rank\n"
        "order = urls[r * 2:] + urls[:r * 2]\n"
        "digests = {u: hashlib.sha256(cache.fetch(u).read_bytes()).hexdigest() for u in order}\n"
        "emit(rank=r, host=socket.gethostname(), lock_mode=cache._locks.policy().mode,\n"
        "     digests=digests, stats=cache.stats().as_dict())\n"
    )
    cache_dir = str(shared_fs.mountpoint / cache_name)
    env = shared_env(cluster, s3, link, cache_name)
    records = task_records(srun_nodes([*task(code), cache_dir, *urls], env, tmp_path), NTASKS)

    expected = {f"s3://{BUCKET}/{k}": hashlib.sha256(v).hexdigest() for k, v in objects.items()}
    for r in records:
        assert r["digests"] == expected, f"rank {r['rank']} read different bytes"
    assert {r["host"] for r in records} == {n.name for n in cluster.nodes}
    assert {r["lock_mode"] for r in records} == {"lease"}  # auto: JuiceFS is a network FS
    gets = {key: s3.count("GET", BUCKET, key) for key in objects}
    assert gets == dict.fromkeys(objects, 1), "a shard was downloaded more than once"
    assert sum(r["stats"]["misses"] for r in records) == len(objects)
    leases = list((shared_fs.host.mountpoint / cache_name / "node" / ".locks").rglob("*.lease"))
    assert leases == [], f"leases left behind: {leases}"
    for node in cluster.nodes:  # each node's processes met in node locks on its own disk
        node_locks = list((node.local / f"node-locks-{cache_name}").rglob("*.lock"))
        assert node_locks, f"no node lock on {node.name}'s local disk"


# The downloader run inside a node: fetches one URL, prints its outcome as one JSON line.
FETCH = """\
import hashlib, json, os, sys, time
from shardcache import ShardCache
cache = ShardCache(cache_dir=sys.argv[1])
path = cache.fetch(sys.argv[2])
print(json.dumps({"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                  "stats": cache.stats().as_dict(), "wall": time.time()}), flush=True)
"""

# A wall clock moved by SHARDCACHE_TEST_CLOCK_SKEW seconds, for the process that imports it
# first thing (``sitecustomize``): the lease records it writes carry that clock's times.
SKEW = """\
import os, time
_skew = float(os.environ.get("SHARDCACHE_TEST_CLOCK_SKEW", "0"))
if _skew:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
"""


def start_in_node(node: Node, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """A downloader process in ``node``'s namespaces (``nsenter`` execs it: same pid)."""
    return subprocess.Popen(
        [*node_prefix(node), PYTHON, "-c", FETCH, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(what: str, condition: Callable[[], bool], timeout: float = WAIT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:g}s")
        time.sleep(0.02)  # polling a condition, bounded by the deadline


def read_lease(locks: Path) -> dict | None:
    for lease in locks.rglob("*.lease"):
        try:
            return json.loads(lease.read_bytes())
        except (OSError, ValueError):
            return None
    return None


def watch_lease(locks: Path, seconds: float) -> list[dict]:
    """Every distinct lease record seen during ``seconds`` (a bounded watch)."""
    seen: list[dict] = []
    start = time.monotonic()

    def long_enough() -> bool:
        record = read_lease(locks)
        if record is not None and (not seen or record != seen[-1]):
            seen.append(record)
        return time.monotonic() - start > seconds

    wait_until(f"{seconds:g}s of watching the lease", long_enough, timeout=2 * seconds)
    return seen


@pytest.mark.parametrize(
    ("skewed", "skew"),
    [("holder", DAY), ("holder", -DAY), ("waiter", DAY)],
    ids=["holder-ahead", "holder-behind", "waiter-ahead"],
)
def test_sigkilled_downloader_taken_over_by_other_node(
    cluster: Cluster,  # noqa: F811
    shared_fs: SharedFS,
    s3: S3Server,
    link: FaultProxy,  # noqa: F811
    tmp_path: Path,
    cache_name: str,
    skewed: str,
    skew: float,
) -> None:
    """Node 1's downloader holds the lease with half the shard received (the link holds the
    rest back) while node 2 waits; one node's clock is a day off. For two lease times and
    more node 2 does not break the live lease (it is renewed); then node 1's downloader is
    SIGKILLed mid-shard and node 2 takes over once the lease went unrenewed for the lease
    time: the shard is published once, intact."""
    body = os.urandom(3_000_000)
    s3.put_objects(BUCKET, {"big.tar": body})
    s3.clear_requests()
    url = f"s3://{BUCKET}/big.tar"
    held = link.add_fault("hold", times=1, method="GET", path_contains="big.tar")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEW)
    base = shared_env(
        cluster,
        s3,
        link,
        cache_name,
        SHARDCACHE_LOCK_STUCK_AFTER="10m",
        SHARDCACHE_LOCK_TIMEOUT="2m",
    )
    base["PYTHONPATH"] = str(site)
    holder_env = {**base, "SHARDCACHE_TEST_CLOCK_SKEW": str(skew if skewed == "holder" else 0)}
    waiter_env = {**base, "SHARDCACHE_TEST_CLOCK_SKEW": str(skew if skewed == "waiter" else 0)}
    cache_dir = str(shared_fs.mountpoint / cache_name)
    locks = shared_fs.host.mountpoint / cache_name / "node" / ".locks"

    holder = start_in_node(cluster.nodes[0], holder_env, cache_dir, url)
    waiter = None
    try:
        wait_until("node 1 holds the lease", lambda: read_lease(locks) is not None)
        first = read_lease(locks)
        assert first is not None and first["host"] == "scnode1", first
        waiter = start_in_node(cluster.nodes[1], waiter_env, cache_dir, url)
        # The live lease, renewed, for more than two lease times: seen changing, never
        # taken by node 2, which keeps waiting.
        seen = watch_lease(locks, 2.5 * LEASE_TIME)
        assert holder.poll() is None and waiter.poll() is None
        assert {r["token"] for r in seen} == {first["token"]}, "node 2 broke a live lease"
        assert len(seen) >= 4, f"the lease was not renewed: {seen}"
        assert s3.count("GET", BUCKET, "big.tar") == 1

        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        out, err = waiter.communicate(timeout=WAIT_TIMEOUT)
    finally:
        held.release()
        for proc in (holder, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert waiter.returncode == 0, err
    result = json.loads(out)
    assert result["sha256"] == hashlib.sha256(body).hexdigest()
    assert result["stats"]["misses"] == 1, result  # node 2 downloaded it itself
    assert result["stats"]["lock_wait_seconds"] >= LEASE_TIME
    assert s3.count("GET", BUCKET, "big.tar") == 2
    assert read_lease(locks) is None
    published = list((shared_fs.host.mountpoint / cache_name / "node" / "data").rglob("*.tar"))
    assert [p.read_bytes() == body for p in published] == [True]
