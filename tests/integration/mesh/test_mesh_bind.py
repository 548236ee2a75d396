"""The mesh server binds the cluster interface only: a node in a network namespace of the
test's own (a veth pair, its own /30) fetches from the address the route to it gives, while
the same port on loopback refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mesh_holder import BUCKET, JOB, SECRET, Holder

from shardcache import PeerFetchError
from shardcache._mesh.address import cluster_address, link_rate
from shardcache._mesh.auth import JobKey, Verifier
from shardcache._mesh.client import Bounds, Peer, fetch_range
from shardcache._mesh.node import upload_cap
from shardcache._mesh.server import MeshServer

REPO = Path(__file__).parents[3]

# The node fetches with the client and prints what it got (its length and first bytes).
NODE = """
import json, sys
from shardcache._mesh.auth import JobKey
from shardcache._mesh.client import Peer, fetch_range
from shardcache._mesh.served import ShardRequest
host, port, secret, job, query = sys.argv[1:6]
got = bytearray()
fetch_range(Peer(host, int(port)), JobKey(bytes.fromhex(secret), job),
            ShardRequest(**json.loads(query)), got.extend)
print(json.dumps([len(got), got[:16].hex()]))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def node_namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace with one veth to the host: (name, host address, node address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    tag = os.getpid() % 16000  # a /30 of 10.218.0.0/16 and names of this process
    name, host_if = f"scmesh{tag}", f"scmh{tag}"
    prefix, last = f"10.218.{tag // 64}", (tag % 64) * 4
    host_ip, node_ip = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", name, "addr", "add", f"{node_ip}/30", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield name, host_ip, node_ip
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", host_if], check=False, capture_output=True, timeout=30)


def test_the_server_binds_the_route_to_the_job_and_nothing_else(
    holder: Holder, node_namespace: tuple[str, str, str]
) -> None:
    name, host_ip, node_ip = node_namespace
    address = cluster_address(node_ip)  # the route to the job's other node
    assert address == host_ip
    request = holder.requests[f"s3://{BUCKET}/b.tar"]
    blob = holder.blobs[f"s3://{BUCKET}/b.tar"]
    with MeshServer(holder.shards(), Verifier(JobKey(SECRET, JOB)), address) as server:
        args = [server.address.split(":")[0], str(server.port), SECRET.hex(), JOB]
        args.append(
            json.dumps(
                {
                    "scope": request.scope,
                    "protocol": request.protocol,
                    "namespace": request.namespace,
                    "url": request.url,
                }
            )
        )
        ran = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, "-c", NODE, *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout) == [len(blob), blob[:16].hex()]
        with pytest.raises(PeerFetchError, match="no answer"):  # not on loopback
            fetch_range(
                Peer("127.0.0.1", server.port),
                JobKey(SECRET, JOB),
                request,
                lambda piece: None,
                bounds=Bounds(timeout=1.0),
            )
        assert server.wait_idle(5)
        assert server.counts()["200"] == 1


def test_the_default_upload_cap_is_half_the_interfaces_speed(node_namespace) -> None:
    """A veth's speed is 10 Gb/s as the kernel gives it; loopback gives none: no cap."""
    _, host_ip, _ = node_namespace
    assert link_rate(host_ip) == 10_000 * 125_000
    assert upload_cap(None, host_ip) == 10_000 * 125_000 / 2
    assert upload_cap(None, "127.0.0.1") is None and link_rate("127.0.0.1") is None
    assert upload_cap(5_000_000, host_ip) == 5_000_000  # the setting wins
