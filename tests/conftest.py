"""Shared fixtures: one moto S3 server per session, reset before each test that uses it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import s3fs
from accounts import Account, make_accounts, world_tmp
from hypothesis import settings
from juicefs import Node, nodes, require_fuse

from shardcache._observe import metrics
from shardcache._retry import throttle
from shardcache.testing import FaultProxy, S3Server

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")

# Property tests draw the same examples on every run (a red CI is reproducible);
# SHARDCACHE_HYPOTHESIS=explore draws new random ones, for a search by hand.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", database=None)
settings.load_profile(os.environ.get("SHARDCACHE_HYPOTHESIS", "deterministic"))


# Under pytest-xdist (scripts/test: two workers, --dist loadgroup) the tests of a group run
# on one worker, one after the other, as in a serial run:
# - "system": tests that start a SLURM cluster (scripts/slurm-local starts and reconfigures
#   the machine's one SLURM) or a multi-process job (torchrun, the benchmark harness), so
#   that two such jobs never compete for the two cores (their jobs have time limits);
# - "accounts": the security tests' second accounts, made with useradd.
# xdist hands out the largest units first, so the groups start at once.
_GROUP_OF_FIXTURE = {"slurm": "system", "cluster": "system", "accounts": "accounts"}
_SYSTEM_MODULES = {"test_resume_torchrun", "test_ddp_epochs", "test_report_job", "test_bench_smoke"}


def _group(item: pytest.Item) -> str | None:
    groups = {
        _GROUP_OF_FIXTURE[f] for f in getattr(item, "fixturenames", ()) if f in _GROUP_OF_FIXTURE
    }
    module = getattr(item, "module", None)
    if module is not None and module.__name__.rsplit(".", 1)[-1] in _SYSTEM_MODULES:
        groups.add("system")
    assert len(groups) <= 1, (item.nodeid, groups)
    return groups.pop() if groups else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker
        return
    for item in items:
        if (group := _group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see no SHARDCACHE_*, torchrun or SLURM settings of the machine they run on."""

    for name in list(os.environ):
        if name.startswith(("SHARDCACHE_", "SLURM_")) or name in _LAUNCHER_VARS:
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _fresh_throttles() -> Iterator[None]:
    """Every test starts with unthrottled processes: a SlowDown another test provoked must
    not slow this one down (the throttle is process-wide on purpose)."""
    throttle.reset_for_tests()
    yield
    throttle.reset_for_tests()


@pytest.fixture(autouse=True)
def _fresh_metrics() -> Iterator[None]:
    """Every test starts with no loader metrics counted and no sinks (process-wide too)."""
    metrics.reset_for_tests()
    yield
    metrics.reset_for_tests()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server in its own process, shared by the whole session."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session server, emptied, with AWS_* pointing at it and fsspec's caches cleared."""
    s3_server.reset()
    fsspec.AbstractFileSystem.clear_instance_cache()
    s3fs.S3FileSystem.clear_instance_cache()
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def fault_proxy(s3: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the (reset) S3 server; no faults until added."""
    with FaultProxy("127.0.0.1", s3.port) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def accounts() -> dict[str, Account]:
    """Real second accounts (tests/accounts.py), made with useradd as root, else skipped."""
    return make_accounts()


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A sticky, world-writable directory every account can reach, removed afterwards."""
    with world_tmp() as path:
        yield path


@pytest.fixture
def jfs_nodes(tmp_path: Path) -> Iterator[list[Node]]:
    """Two "nodes": two JuiceFS mounts of one fresh volume (tests/juicefs.py), each with its
    own node-local directory; skipped without FUSE (failed under SHARDCACHE_REQUIRE_SLURM=1).
    Attribute and entry caches are off, so each node sees the other's changes at once."""
    require_fuse()
    with nodes(tmp_path / "jfs", 2, cache_seconds=0) as made:
        yield made
