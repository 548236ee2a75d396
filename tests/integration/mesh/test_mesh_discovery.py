"""Discovery of the cache mesh with real processes as nodes on 127.0.0.1, meeting through a
real TCPStore (SLURM task 0 hosts it) and through a shared directory: each node's cache
starts its server (SHARDCACHE_MESH=1) and publishes it; each reads the others'; a node given
another secret is left out (and its request refused by the server); a node that never
publishes is absent once the bound has passed; then one signed fetch between two nodes at
the discovered address."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from ports import reserved_port
from processes import TOGETHER_TIMEOUT, collect

from tools.processes import CTX

BUCKET = "meshdiscovery"
KEY = "shard-0.tar"
BLOB = os.urandom(1_000_000)
SECRET, OTHER = "a" * 32, "b" * 32
NODES, STARTED = 4, 3  # node 3 never starts: it never publishes
TIMEOUT = 6  # seconds a node waits for the others' addresses
pytestmark = pytest.mark.timeout(TOGETHER_TIMEOUT)


def node_env(node: int, place: str, where: str, s3_env: dict[str, str]) -> dict[str, str]:
    """Node ``node``'s variables: a SLURM task alone on its node, the mesh on."""
    env = {
        **s3_env,
        "SLURM_JOB_ID": "4301",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(NODES),
        "SLURM_STEP_NUM_NODES": str(NODES),
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SHARDCACHE_MESH": "1",
        "SHARDCACHE_MESH_SECRET": OTHER if node == 2 else SECRET,
        "SHARDCACHE_RENDEZVOUS_TIMEOUT": f"{TIMEOUT}s",
    }
    if place == "store":
        return env | {"SHARDCACHE_RENDEZVOUS_PORT": where}
    return env | {"SHARDCACHE_RENDEZVOUS_DIR": where, "SHARDCACHE_MESH_ADDR": "127.0.0.1"}


def node_process(env: dict[str, str], root: str, hosted: Any, ready: Any, out: Any) -> None:
    """One node (see :func:`node`); an error is reported, and breaks the barriers so the
    other nodes do not wait for it."""
    os.environ.update(env)
    try:
        out.put(node(int(env["SLURM_NODEID"]), root, hosted, ready))
    except BaseException:
        hosted.abort()
        ready.abort()
        out.put({"node": int(env["SLURM_NODEID"]), "error": traceback.format_exc()})


def node(me: int, root: str, hosted: Any, ready: Any) -> dict[str, Any]:
    """Node 0 makes its cache first (task 0 hosts the store), caches the shard and offers
    it; the others then make theirs. Node 1 fetches the shard from node 0 at the address it
    discovered; node 2 (another secret) asks node 0's published port and is refused."""
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardcache.mesh").addHandler(handler)
    if "SHARDCACHE_RENDEZVOUS_PORT" in os.environ:  # the store's nodes meet through torch
        import torch.distributed  # noqa: F401  (imported before the clock starts, as a job has)

    from shardcache import PeerFetchError, ShardCache
    from shardcache._mesh.client import Peer, fetch_range
    from shardcache._mesh.served import ShardRequest

    url = f"s3://{BUCKET}/{KEY}"
    if me != 0:
        hosted.wait()  # the barriers: a node failing aborts them; the test's timeout a hang
    began = time.monotonic()
    cache = ShardCache(root, scope="node")
    mesh = cache.mesh
    assert mesh is not None and mesh.server is not None
    shard = cache._identify(url)
    if me == 0:
        cache.fetch(url)
        mesh.offered.add([(shard.canonical_url, shard.namespace)])
        hosted.wait()
    settled = mesh.membership.wait(TOGETHER_TIMEOUT)  # it reads for TIMEOUT s at most
    result: dict[str, Any] = {
        "node": me,
        "settled": settled,
        "waited": time.monotonic() - began,
        "port": mesh.server.port,
        "peers": {n: (p.host, p.port) for n, p in mesh.membership.peers().items()},
        "refused": mesh.membership.refused,
        "absent": mesh.membership.absent,
    }
    ready.wait()  # every node has read the others: fetch
    request = ShardRequest("node", shard.protocol, shard.namespace, shard.canonical_url)
    got = bytearray()
    if me == 1:
        answer = fetch_range(
            mesh.membership.peers()[0], mesh.membership.job_key, request, got.extend
        )
        result["fetched"] = (hashlib.sha256(got).hexdigest(), answer.record["size"])
    if me == 2:  # node 0's address as its record gives it, though node 2 left node 0 out
        record = json.loads(_board_record(0))
        try:
            fetch_range(
                Peer(record["host"], record["port"]), mesh.membership.job_key, request, got.extend
            )
        except PeerFetchError as exc:
            result["refused_fetch"] = exc.status
    ready.wait()  # the fetches are done
    if me == 0:
        assert mesh.server.wait_idle(TOGETHER_TIMEOUT)
        result["counts"] = mesh.server.counts()
    result["warnings"] = warnings
    return result


def _board_record(node: int) -> bytes:
    """Node ``node``'s record, read from the job's board as discovery reads it."""
    from shardcache._config.rendezvous import rendezvous
    from shardcache._config.settings import Settings
    from shardcache._mesh.discovery import record_name
    from shardcache._mesh.node import _board

    settings = Settings.resolve()
    meet = rendezvous(settings.rendezvous_port, settings.rendezvous_dir)
    assert not isinstance(meet, str)
    return _board(meet, 10, hosting=False).get(record_name(node))


def run_jobs(jobs: dict[str, str], tmp_path: Path, s3_env: dict[str, str]) -> dict[str, list]:
    """Each job (place -> where its nodes meet) as ``STARTED`` node processes, all jobs at
    once; each job's results by node."""
    started: dict[str, list] = {}  # place -> its node processes
    outs, barriers = {}, []
    for place, where in jobs.items():
        hosted, ready, outs[place] = CTX.Barrier(STARTED), CTX.Barrier(STARTED), CTX.Queue()
        barriers += [hosted, ready]
        for n in range(STARTED):
            env, root = node_env(n, place, where, s3_env), str(tmp_path / place / f"n{n}")
            args = (env, root, hosted, ready, outs[place])
            started.setdefault(place, []).append(CTX.Process(target=node_process, args=args))
    procs = [proc for place in started.values() for proc in place]
    for proc in procs:
        proc.start()
    try:  # each job's results, awaited as long as its nodes live
        results = {place: collect(out, started[place], STARTED) for place, out in outs.items()}
        for proc in procs:
            proc.join()
    finally:
        for barrier in barriers:
            barrier.abort()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    for got in results.values():
        assert not [r["error"] for r in got if "error" in r]
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return {place: sorted(got, key=lambda r: r["node"]) for place, got in results.items()}


def test_nodes_find_each_other_and_fetch_at_the_discovered_address(s3, tmp_path: Path) -> None:
    """Two jobs at once: one meets through SLURM task 0's store, one through a directory."""
    s3.put_objects(BUCKET, {KEY: BLOB})
    with reserved_port() as port:
        jobs = {"store": str(port), "directory": str(tmp_path / "shared")}
        for place, results in run_jobs(jobs, tmp_path, s3.env()).items():
            check_job(place, results)


def check_job(place: str, results: list[dict]) -> None:
    ports = {r["node"]: r["port"] for r in results}
    for r in results:
        assert r["settled"] and r["absent"] == [3], (place, r)
        # Node 3 waited for, TIMEOUT s (a bound tests/unit/mesh/test_discovery.py checks by
        # the clock): the reading ended by itself ("settled").
        assert r["waited"] >= TIMEOUT, (place, r)
        assert any("nodes 3 of 4 published no address" in w for w in r["warnings"]), r
    for r in results[:2]:
        assert r["peers"] == {n: ("127.0.0.1", ports[n]) for n in {0, 1} - {r["node"]}}, r
        assert list(r["refused"]) == [2] and "fingerprint" in r["refused"][2], r
        assert any(
            "node 2 is left out" in w and "SHARDCACHE_MESH_SECRET" in w for w in r["warnings"]
        )
    assert results[2]["peers"] == {} and sorted(results[2]["refused"]) == [0, 1], place
    assert results[1]["fetched"] == (hashlib.sha256(BLOB).hexdigest(), len(BLOB)), place
    assert results[2]["refused_fetch"] == 403  # the server refuses another secret's request
    counts = results[0]["counts"]  # the server's own counts, not only the clients'
    assert (counts["200"], counts["403"], counts["bytes"]) == (1, 1, len(BLOB)), (place, counts)
