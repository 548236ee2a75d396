"""The spool that carries DataLoader workers' epoch totals to their main process: a real
forked child hands its total over, and a directory or link another user planted in the
shared temporary directory is refused, never written through nor read from."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import tempfile
from pathlib import Path

import pytest

from shardcache._observe.spool import spool, spool_root, unspool

OTHER_UID = 65534  # nobody: a user who is not this process
TOTAL = {"epoch": 3, "samples": 40, "hits": 2}


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory the spool lives in, this test's own (forked children too)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _spool_in_a_child(total: dict) -> None:
    child = mp.get_context("fork").Process(target=spool, args=(total,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0


def test_a_forked_workers_total_reaches_its_parent_once(private_tmp: Path) -> None:
    _spool_in_a_child(TOTAL)
    _spool_in_a_child({**TOTAL, "samples": 8})
    assert sorted(t["samples"] for t in unspool()) == [8, 40]
    assert unspool() == []
    assert not (spool_root() / str(os.getpid())).exists()  # removed once read
    assert spool_root() == private_tmp / f"shardcache-{os.geteuid()}" / "metrics-spool"
    assert oct(spool_root().stat().st_mode & 0o777) == "0o700"


def test_totals_spooled_before_this_process_started_are_not_read(private_tmp: Path) -> None:
    """Workers of an earlier process that had this pid left a total behind (their parent
    exited first): the next process with the pid must not count it, nor keep it."""
    _spool_in_a_child(TOTAL)
    [left] = (spool_root() / str(os.getpid())).iterdir()
    os.utime(left, (left.stat().st_atime, left.stat().st_mtime - 3600))  # from an hour ago
    _spool_in_a_child({**TOTAL, "samples": 8})
    assert [t["samples"] for t in unspool()] == [8]
    assert not left.exists()


def _plant_foreign_spool(private_tmp: Path) -> Path:
    """Another user's spool directory, with a total of theirs for this process to read."""
    root = spool_root()
    planted = root / str(os.getpid()) / "1-e0-1.json"
    planted.parent.mkdir(parents=True)
    planted.write_text(json.dumps({**TOTAL, "samples": 999}))
    for path in (root, planted.parent, planted):
        os.chown(path, OTHER_UID, OTHER_UID)
    return planted


def test_another_users_spool_directory_is_neither_read_nor_written(
    private_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    planted = _plant_foreign_spool(private_tmp)
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        assert unspool() == []
        spool(TOTAL)  # into this process's parent's directory, inside the foreign one
    assert planted.exists(), "another user's file was removed"
    assert [p.name for p in spool_root().rglob("*")] == [planted.parent.name, planted.name]
    warnings = [r.getMessage() for r in caplog.records]
    assert any("cannot read the metrics this process's workers spooled" in w for w in warnings)
    assert any(
        "cannot hand this worker's metrics to its main process" in w and str(spool_root()) in w
        for w in warnings
    ), warnings


def test_a_link_planted_at_the_spool_is_not_followed(
    private_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = private_tmp / "elsewhere"
    (elsewhere / str(os.getppid())).mkdir(parents=True)
    spool_root().parent.mkdir(mode=0o700)
    spool_root().symlink_to(elsewhere)
    os.lchown(spool_root(), OTHER_UID, OTHER_UID)  # another user's link: they could repoint it
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        spool(TOTAL)
        assert unspool() == []
    assert list(elsewhere.rglob("*.json*")) == []
    assert any("cannot hand this worker's metrics" in r.getMessage() for r in caplog.records)
