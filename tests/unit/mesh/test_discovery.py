"""Discovery's record and its reading: the record's format, the peers read from a board of
real files, a node of another key or a damaged record left out with the reason, a node that
never publishes absent once the bound has passed; the node count from the launcher."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

import pytest

from shardcache import ConfigError
from shardcache._config.launcher import node_count
from shardcache._meeting.board import DirectoryBoard
from shardcache._mesh.auth import JobKey
from shardcache._mesh.client import Peer
from shardcache._mesh.discovery import MeshMembership, MeshRecord, record_name
from shardcache._mesh.node import ScopeLayouts

KEY = JobKey(b"k" * 32, "job")


def _record(node: int, port: int, print_: str = "f" * 16) -> MeshRecord:
    return MeshRecord(f"10.0.0.{node + 1}", port, node, "boot", 4242, print_)


def test_the_record_reads_back_and_says_what_is_wrong_with_a_bad_one() -> None:
    record = _record(3, 40001)
    data = record.encode()
    assert json.loads(data) == {
        "host": "10.0.0.4",
        "port": 40001,
        "node": 3,
        "boot_id": "boot",
        "pid": 4242,
        "fingerprint": "f" * 16,
    }
    assert MeshRecord.decode(data) == record and record.peer == Peer("10.0.0.4", 40001)
    fields = json.loads(data)
    bad = {
        b"not json": "Expecting value",
        json.dumps(fields | {"extra": 1}).encode(): "not a mesh record",
        json.dumps({k: v for k, v in fields.items() if k != "pid"}).encode(): "not a mesh record",
        json.dumps(fields | {"port": "40001"}).encode(): "port is not int",
        json.dumps(fields | {"port": 0}).encode(): "port 0",
        json.dumps([1, 2]).encode(): "not a mesh record",
    }
    for text, why in bad.items():
        with pytest.raises(ValueError, match=why):
            MeshRecord.decode(text)


def _membership(folder: Path, nodes: int, timeout: float) -> MeshMembership:
    return MeshMembership(
        0, nodes, KEY, "f" * 16, board=lambda: DirectoryBoard(folder, "addresses"), timeout=timeout
    )


def test_peers_are_read_and_a_node_of_another_key_or_a_bad_record_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    board = DirectoryBoard(tmp_path, "addresses")
    board.put(record_name(1), _record(1, 40001).encode())
    board.put(record_name(2), _record(2, 40002, "0" * 16).encode())
    board.put(record_name(3), b"{damaged")
    board.put(record_name(4), _record(5, 40005).encode())  # names another node
    with caplog.at_level(logging.WARNING, logger="shardcache.mesh"):
        membership = _membership(tmp_path, 5, 10)
        assert membership.wait(10)
    assert membership.peers() == {1: Peer("10.0.0.2", 40001)} and membership.absent == []
    assert sorted(membership.refused) == [2, 3, 4]
    assert "fingerprint 0000000000000000" in membership.refused[2]
    assert "SHARDCACHE_MESH_SECRET" in membership.refused[2]
    assert "node 5" in membership.refused[4]
    assert any("node 2 is left out" in r.getMessage() for r in caplog.records)


def test_a_node_that_never_publishes_is_absent_once_the_bound_has_passed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    DirectoryBoard(tmp_path, "addresses").put(record_name(1), _record(1, 40001).encode())
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shardcache.mesh"):
        membership = _membership(tmp_path, 3, 0.5)
        assert membership.peers() in ({}, {1: Peer("10.0.0.2", 40001)})  # never blocks
        assert membership.wait(10)
    assert 0.5 <= time.monotonic() - began < 5
    assert membership.peers() == {1: Peer("10.0.0.2", 40001)} and membership.absent == [2]
    assert any("nodes 2 of 3 published no address" in r.getMessage() for r in caplog.records)


def test_the_node_count_comes_from_the_launcher() -> None:
    assert node_count({"GROUP_WORLD_SIZE": "4", "SLURM_STEP_NUM_NODES": "2"}) == 4
    assert node_count({"SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NUM_NODES": "3"}) == 2
    assert node_count({"SLURM_NNODES": "7"}) == 7
    assert node_count({}) is None
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NUM_NODES='none'.*number of nodes"):
        node_count({"SLURM_STEP_NUM_NODES": "none"})


def test_only_scope_directories_of_the_root_are_served(tmp_path: Path) -> None:
    layouts = ScopeLayouts(tmp_path, None)  # type: ignore[arg-type]
    assert layouts["node"].scope_dir == tmp_path / "node"
    assert layouts["rank-12"].scope_dir == tmp_path / "rank-12"
    for name in ("..", "rank-1/..", "rank-x", "/etc", "nodes", ""):
        assert layouts.get(name) is None
    assert sorted(layouts) == ["node", "rank-12"]


class CountingBoard(DirectoryBoard):
    """A board of real files that counts its reads and, after its first wait, has
    ``late`` published (a node that comes up after the first round)."""

    def __init__(self, folder: Path, late: dict[str, bytes]) -> None:
        super().__init__(folder, "addresses")
        self.late, self.calls = late, Counter[str]()

    def wait(self, names, timeout):  # type: ignore[no-untyped-def]
        self.calls["wait"] += 1
        waited = super().wait(names, timeout)
        for name, data in self.late.items():
            self.put(name, data)
        self.late = {}
        return waited

    def get_many(self, names):  # type: ignore[no-untyped-def]
        self.calls["get_many"] += 1
        return super().get_many(names)


def test_records_present_are_read_with_one_wait_and_one_read_whatever_the_node_count(
    tmp_path: Path,
) -> None:
    board = CountingBoard(tmp_path, {})
    for node in range(1, 50):
        board.put(record_name(node), _record(node, 40000 + node).encode())
    membership = MeshMembership(0, 50, KEY, "f" * 16, board=lambda: board, timeout=10)
    assert membership.wait(10) and len(membership.peers()) == 49
    assert board.calls == {"wait": 1, "get_many": 1}


def test_a_node_that_publishes_late_is_read_in_a_later_round(tmp_path: Path) -> None:
    board = CountingBoard(tmp_path, {record_name(2): _record(2, 40002).encode()})
    board.put(record_name(1), _record(1, 40001).encode())
    membership = MeshMembership(0, 3, KEY, "f" * 16, board=lambda: board, timeout=10)
    assert membership.wait(10) and membership.absent == []
    assert sorted(membership.peers()) == [1, 2]
    assert board.calls == {"wait": 2, "get_many": 2}  # the second round waits for node 2 only
