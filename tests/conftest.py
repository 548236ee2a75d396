"""Shared fixtures: one moto S3 server per session and, for the tests that ask for them, one
SeaweedFS server, one GCS emulator and one Azurite per session (per xdist worker), each
reset before each test that uses it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import pytest
import s3fs
from accounts import Account, make_accounts, world_tmp
from hypothesis import settings
from mounts import require_fuse
from threads import PrefetchThreads

from shardcache.testing import (
    AzuriteServer,
    FaultProxy,
    GcsEmulator,
    S3Server,
    SeaweedS3Server,
    fresh_process_state,
)

if TYPE_CHECKING:
    from tools.juicefs import Node

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")

# Property tests draw the same examples on every run (a red CI is reproducible);
# SHARDCACHE_HYPOTHESIS=explore draws new random ones, for a search by hand.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", database=None)
settings.load_profile(os.environ.get("SHARDCACHE_HYPOTHESIS", "deterministic"))


# Under pytest-xdist (scripts/test: two workers) the test files of a group run on one worker,
# one test after the other, as in a serial run; every other test goes wherever a worker is
# free:
# - "system": the files that start a SLURM cluster (scripts/slurm-local starts, reconfigures
#   and takes down the machine's one SLURM) or a torchrun job, so that two such jobs never
#   compete for the two cores (their jobs have time limits), and test_node_lock.py, whose
#   waiters give up on a holder that shows no progress for 20 s through a chain of polls on
#   JuiceFS (it timed out once beside such a job);
# - "bench": the benchmark harness at tiny size (its own servers and processes), on the
#   other worker from the start: it checks no time, and its limits are several times its
#   run time. In the "system" group it lengthened that group, the suite's critical path,
#   while the other worker waited at the end;
# - "accounts": the security tests, whose second accounts are made with useradd.
# The groups are whole files, assigned by the scheduler below (xdist's own --dist loadgroup
# renames node ids, which pytest 9.2 no longer allows: it silently grouped nothing). A test
# that uses a group's fixture from a file outside the group fails at collection. Files are
# named by basename (unique across tests/), wherever they sit; the "system" group is not the
# folder tests/system: the JuiceFS and torture tests there go to either worker.
_GROUP_FILES = {
    "system": {
        "test_ddp_epochs.py",
        "test_index_exchange_jobs.py",
        "test_mesh_discovery_torchrun.py",
        "test_mesh_slurm.py",
        "test_node_lock.py",
        "test_report_job.py",
        "test_resume_slurm.py",
        "test_resume_torchrun.py",
        "test_sbatch_resumable_slurm.py",
        "test_slurm.py",
        "test_slurm_epochs.py",
        "test_slurm_nodes.py",
        "test_slurm_nodes_shared_fs.py",
    },
    "bench": {"test_bench_smoke.py"},
    "accounts": {"test_security.py", "test_mesh_security.py"},
}
_GROUP_OF_FILE = {name: group for group, names in _GROUP_FILES.items() for name in names}
_GROUP_OF_FIXTURE = {"slurm": "system", "cluster": "system", "accounts": "accounts"}


def _group_of(nodeid: str) -> str | None:
    return _GROUP_OF_FILE.get(Path(nodeid.split("::", 1)[0]).name)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with a scope per group (the largest go out first) and one
    per test otherwise."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid) or nodeid

    return GroupScheduling(config, log)


# Collected last, so that it runs at the end of its group, long after the "bench" group on
# the other worker is over (its 20 s patience is what the bench's load could upset).
_LAST_FILES = {"test_node_lock.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: Path(item.nodeid.split("::", 1)[0]).name in _LAST_FILES)
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            group = _GROUP_OF_FIXTURE.get(fixture)
            if group is not None and _group_of(item.nodeid) != group:
                raise pytest.UsageError(
                    f"{item.nodeid} uses the fixture {fixture!r}: add its file to the "
                    f"{group!r} group of tests/conftest.py (_GROUP_FILES)"
                )


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see no SHARDCACHE_*, torchrun or SLURM settings of the machine they run on."""

    for name in list(os.environ):
        if name.startswith(("SHARDCACHE_", "SLURM_")) or name in _LAUNCHER_VARS:
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _own_process_state() -> Iterator[None]:
    """Every test starts with no loader metrics counted, no sinks and unthrottled: a
    SlowDown another test provoked must not slow this one down (both are process-wide on
    purpose)."""
    with fresh_process_state():
        yield


@pytest.fixture
def prefetch_threads() -> PrefetchThreads:
    """The prefetch threads alive before the test, to check that the ones it started end."""
    return PrefetchThreads()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server in its own process, shared by the whole session."""
    with S3Server() as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_server() -> Iterator[SeaweedS3Server]:
    """A SeaweedFS server (``weed server -s3``, up in a few seconds), shared by the session
    (required, as the GCS emulator: the testing extra installs it)."""
    with SeaweedS3Server() as server:
        yield server


# The session server behind each name of tests/support/servers.py's S3_SERVERS.
_S3_SERVER_FIXTURES = {"moto": "s3_server", "seaweedfs": "seaweedfs_server"}


def _emptied(server: S3Server | SeaweedS3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reset ``server``, point AWS_* at it and clear fsspec's caches."""
    server.reset()
    fsspec.AbstractFileSystem.clear_instance_cache()
    s3fs.S3FileSystem.clear_instance_cache()
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def s3(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session's moto server, emptied, with AWS_* pointing at it and fsspec's caches
    cleared; parametrized indirectly (``servers.on_s3_servers``) the named server instead."""
    server = request.getfixturevalue(_S3_SERVER_FIXTURES[getattr(request, "param", "moto")])
    _emptied(server, monkeypatch)
    return server


@pytest.fixture
def seaweedfs(
    seaweedfs_server: SeaweedS3Server, monkeypatch: pytest.MonkeyPatch
) -> SeaweedS3Server:
    """The session's SeaweedFS server, emptied, with AWS_* pointing at it."""
    _emptied(seaweedfs_server, monkeypatch)
    return seaweedfs_server


@pytest.fixture
def fault_proxy(s3: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the (reset) S3 server; no faults until added."""
    with FaultProxy("127.0.0.1", s3.port) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsEmulator]:
    """The GCS emulator in its own process, shared by the whole session (required: a
    missing one fails the tests that use it, with how to install it)."""
    with GcsEmulator() as server:
        yield server


@pytest.fixture
def gcs(gcs_server: GcsEmulator) -> GcsEmulator:
    """The session's GCS emulator, emptied, with fsspec's instance cache cleared."""
    gcs_server.reset()
    fsspec.AbstractFileSystem.clear_instance_cache()
    return gcs_server


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[AzuriteServer]:
    """Azurite's blob service in its own process, shared by the whole session (required,
    as the GCS emulator)."""
    with AzuriteServer() as server:
        yield server


@pytest.fixture
def azurite(azurite_server: AzuriteServer) -> AzuriteServer:
    """The session's Azurite, emptied, with fsspec's instance cache cleared."""
    azurite_server.reset()
    fsspec.AbstractFileSystem.clear_instance_cache()
    return azurite_server


@pytest.fixture(scope="session")
def accounts() -> dict[str, Account]:
    """Real second accounts (tests/support/accounts.py), made with useradd as root, else
    skipped."""
    return make_accounts()


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A sticky, world-writable directory every account can reach, removed afterwards."""
    with world_tmp() as path:
        yield path


@pytest.fixture
def jfs_nodes(tmp_path: Path) -> Iterator[list[Node]]:
    """Two "nodes": two JuiceFS mounts of one fresh volume (tools/juicefs.py), each
    with its own node-local directory; skipped without FUSE (failed under
    SHARDCACHE_REQUIRE_SLURM=1). Attribute and entry caches are off, so each node sees the
    other's changes at once."""
    from tools.juicefs import nodes  # not at the top: check-dist runs without tools

    require_fuse()
    with nodes(tmp_path / "jfs", 2, cache_seconds=0) as made:
        yield made
