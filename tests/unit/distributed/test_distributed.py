"""shardcache.distributed: rank info, race-free makedirs, diagnosed waits, torch.distributed."""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import pickle
import queue
import subprocess
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from shardcache import ConfigError, ShardCacheError, WaitTimeout
from shardcache import distributed as sd
from shardcache._base.fsinfo import mount_for
from shardcache._config.launcher import parse_tasks_per_node

LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NODEID",
    "SLURM_JOB_ID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher or SHARDCACHE_* variables: each test sets exactly what it needs."""
    for name in list(os.environ):
        if name in LAUNCHER_VARS or name.startswith("SHARDCACHE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def _collect(results: Any, count: int, timeout: float) -> list[Any]:
    return [results.get(timeout=timeout) for _ in range(count)]


def _join_all(procs: list[Any], timeout: float) -> None:
    for proc in procs:
        proc.join(timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# -- rank_info -----------------------------------------------------------------------------


def test_rank_info_defaults(clean_env: pytest.MonkeyPatch) -> None:
    info = sd.rank_info()
    assert info == sd.RankInfo(0, 0, 1, None, 0, None, "default")
    assert "rank 0/1" in info.describe()


def test_rank_info_torchrun(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RUN_ID": "run-7",
    }.items():
        clean_env.setenv(name, value)
    assert sd.rank_info() == sd.RankInfo(
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        job_id="run-7",
        source="torchrun",
    )


def test_rank_info_slurm_tasks_per_node(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "2",
        "SLURM_NTASKS": "8",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_TASKS_PER_NODE": "4(x2)",
    }.items():
        clean_env.setenv(name, value)
    assert sd.rank_info() == sd.RankInfo(6, 2, 8, 4, 1, "4242", "slurm")
    clean_env.setenv("SLURM_NTASKS_PER_NODE", "3")  # explicit --ntasks-per-node wins
    assert sd.rank_info().local_world_size == 3


def test_rank_info_torchrun_under_slurm_prefers_torchrun(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_NODEID": "1",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        clean_env.setenv(name, value)
    info = sd.rank_info()
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert (info.node_rank, info.source) == (1, "torchrun")


@pytest.mark.parametrize(
    ("text", "node", "expected"),
    [("8", 0, 8), ("4(x2)", 1, 4), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4(x2)", 9, 4)],
)
def test_slurm_tasks_per_node_parsing(text: str, node: int, expected: int) -> None:
    assert parse_tasks_per_node(text, node, "SLURM_TASKS_PER_NODE") == expected


@pytest.mark.parametrize("text", ["", "4(2)", "x", "2(x3),1;"])
def test_slurm_tasks_per_node_malformed(text: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node(text, 0, "SLURM_TASKS_PER_NODE")


def test_rank_info_bad_local_world_size(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE='four'"):
        sd.rank_info()


def test_import_does_not_import_torch() -> None:
    code = "import sys, shardcache.distributed; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


# -- makedirs -------------------------------------------------------------------------------

DEEP = ("a/b/c/d/e/f/g/h", "a/b/c/d/x/y", "a/b/q/r/s/t/u", "a/b/c/d/e/f/g/h/i/j")


def _makedirs_worker(root: str, index: int, start: Any, results: Any) -> None:
    try:
        start.wait(30)
        # Each process visits the paths in a different order: every prefix is contended.
        order = DEEP[index % len(DEEP) :] + DEEP[: index % len(DEEP)]
        made = [str(sd.makedirs(Path(root, rel), timeout=10)) for rel in order]
        results.put((index, "ok", made))
    except BaseException:
        results.put((index, "error", traceback.format_exc()))


@pytest.mark.timeout(60)
def test_makedirs_eight_processes_race(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    start, results = ctx.Barrier(8), ctx.Queue()
    procs = [
        ctx.Process(target=_makedirs_worker, args=(str(tmp_path), i, start, results))
        for i in range(8)
    ]
    for proc in procs:
        proc.start()
    try:
        got = _collect(results, 8, timeout=40)
    finally:
        _join_all(procs, 10)
    errors = [detail for _, status, detail in got if status != "ok"]
    assert not errors, "\n".join(errors)
    for _, _, made in got:
        assert sorted(made) == sorted(str(tmp_path / rel) for rel in DEEP)
    assert all((tmp_path / rel).is_dir() for rel in DEEP)
    assert [proc.exitcode for proc in procs] == [0] * 8


def test_makedirs_returns_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    made = sd.makedirs("x/y")
    assert made == tmp_path / "x" / "y"
    assert made.is_absolute() and made.is_dir()
    assert sd.makedirs("x/y") == made  # existing: success


# -- wait_for ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_wait_for_sees_directory_created_by_another_thread(tmp_path: Path) -> None:
    target = tmp_path / "made" / "later"
    first_check_done = threading.Event()
    checks = []

    def create() -> None:
        first_check_done.wait(20)
        target.mkdir(parents=True)

    def predicate() -> bool:
        result = target.is_dir()
        checks.append(result)
        first_check_done.set()  # the creator starts only after a failed check
        return result

    creator = threading.Thread(target=create)
    creator.start()
    try:
        sd.wait_for(predicate, "a directory made by a thread", timeout=20, path=target, poll=0.01)
    finally:
        creator.join(20)
    assert checks[0] is False and checks[-1] is True
    assert not creator.is_alive()


def test_wait_for_treats_estale_as_not_yet() -> None:
    calls = []

    def predicate() -> bool:
        calls.append(1)
        if len(calls) <= 3:
            raise OSError(errno.ESTALE, "Stale file handle")
        return True

    sd.wait_for(predicate, "a flaky NFS handle", timeout=10, poll=0.001, max_poll=0.01)
    assert len(calls) == 4


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOENT])
def test_wait_for_other_not_yet_errors(code: int) -> None:
    calls = []

    def predicate() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(code, os.strerror(code))
        return True

    sd.wait_for(predicate, "x", timeout=10, poll=0.001)
    assert len(calls) == 2


def test_wait_for_propagates_real_errors() -> None:
    def denied() -> bool:
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        sd.wait_for(denied, "x", timeout=10)

    def broken() -> bool:
        raise ValueError("bug")

    with pytest.raises(ValueError, match="bug"):
        sd.wait_for(broken, "x", timeout=10)


@pytest.fixture
def crowded_parent(tmp_path: Path) -> Path:
    parent = tmp_path / "parent"
    parent.mkdir()
    for i in range(25):
        (parent / f"entry-{i:02d}").touch()
    return parent


@pytest.mark.timeout(30)
def test_wait_for_timeout_diagnostics(crowded_parent: Path, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    target = crowded_parent / "never"
    checks = []

    def never() -> bool:
        checks.append(1)
        return sd._is_dir(target)

    with pytest.raises(WaitTimeout) as caught:
        sd.wait_for(never, "the never directory", timeout=0.5, path=target, poll=0.02)
    exc = caught.value
    msg = str(exc)
    assert isinstance(exc, TimeoutError) and isinstance(exc, ShardCacheError)
    assert "the never directory" in msg and str(target) in msg
    assert "rank 3/4" in msg and "host " in msg and "exists now: no" in msg
    assert mount_for(target).fstype in msg
    assert "(25 entries)" in msg and "entry-00" in msg and "entry-19" in msg
    assert "entry-20" not in msg and "5 more" in msg
    assert "FileNotFoundError" in msg  # the last error seen
    assert "shardcache.distributed.makedirs" in msg and "actimeo" in msg
    assert exc.elapsed >= 0.5  # never gives up before the timeout
    # Backoff, not a busy loop: polls 0.02 s doubling (jitter x0.5-1.5) reach 0.5 s in at
    # most 6 sleeps, then one last check at the deadline; a fixed 0.02 s poll would make 26.
    assert exc.checks == len(checks) and 2 <= len(checks) <= 7, len(checks)
    assert (exc.what, exc.path, exc.rank) == ("the never directory", str(target), 3)
    assert exc.parent_count == 25 and len(exc.parent_entries) == 20
    assert exc.fstype == mount_for(target).fstype

    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is WaitTimeout and str(again) == msg
    for name in ("what", "path", "elapsed", "host", "rank", "last_error", "parent_entries"):
        assert getattr(again, name) == getattr(exc, name)


def test_wait_for_timeout_without_path() -> None:
    with pytest.raises(WaitTimeout, match=r"timed out after .* waiting for a condition") as caught:
        sd.wait_for(lambda: False, "a condition", timeout=0.05, poll=0.01)
    assert caught.value.path is None and "last error: none" in str(caught.value)


def test_wait_for_timeout_missing_parent(tmp_path: Path) -> None:
    target = tmp_path / "no" / "such" / "dir"
    with pytest.raises(WaitTimeout, match="cannot list") as caught:
        sd.wait_for(target.is_dir, "x", timeout=0.05, path=target)
    assert caught.value.parent_count is None


def test_wait_for_logs_progress(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shardcache.distributed")
    with pytest.raises(WaitTimeout):
        sd.wait_for(
            lambda: False,
            "logged thing",
            timeout=0.2,
            path=tmp_path / "n",
            poll=0.01,
            progress_every=0.0,
        )
    assert any("still waiting for logged thing" in r.getMessage() for r in caplog.records)


# -- makedirs_once without a process group --------------------------------------------------


def test_makedirs_once_local_rank_zero_creates(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.chdir(tmp_path)
    made = sd.makedirs_once(["a/b", tmp_path / "c"])
    assert made == [tmp_path / "a" / "b", tmp_path / "c"]
    assert all(p.is_dir() for p in made)
    assert sd.makedirs_once("single") == [tmp_path / "single"]
    assert sd.barrier() is False


@pytest.mark.timeout(30)
def test_makedirs_once_other_rank_waits(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        clean_env.setenv(name, value)
    targets = [tmp_path / "x" / "y", tmp_path / "z"]
    waiting = threading.Event()
    real_wait_for = sd.wait_for

    def spy_wait_for(*args: Any, **kwargs: Any) -> None:
        waiting.set()
        real_wait_for(*args, **kwargs)

    clean_env.setattr(sd, "wait_for", spy_wait_for)

    def local_rank_zero() -> None:
        waiting.wait(20)  # create only once the other rank is really waiting
        for target in targets:
            target.mkdir(parents=True)

    creator = threading.Thread(target=local_rank_zero)
    creator.start()
    try:
        assert sd.makedirs_once(targets, timeout=20) == targets
    finally:
        creator.join(20)
    assert all(t.is_dir() for t in targets)


def test_makedirs_once_other_rank_times_out(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LOCAL_RANK", "1")
    with pytest.raises(WaitTimeout, match="made by local rank 0") as caught:
        sd.makedirs_once([tmp_path / "never"], timeout=0.2)
    assert caught.value.path == str(tmp_path / "never")
    assert not (tmp_path / "never").exists()


# -- a real torch.distributed job -----------------------------------------------------------


def _torch_worker(rank: int, world: int, store: str, root: str, results: Any) -> None:
    # Like torchrun on one node: LOCAL_RANK is set, RANK/WORLD_SIZE deliberately are not,
    # so ranks 0/1 in rank_info() can only come from the process group.
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=30),
        )
        try:
            targets = [Path(root, "shared", "a", "b"), Path(root, "shared", "c")]
            seen_at_makedirs: list[bool] = []
            real_makedirs = sd.makedirs

            def spy_makedirs(path: Path | str, **kwargs: Any) -> Path:
                seen_at_makedirs.append(Path(path).is_dir())
                return real_makedirs(path, **kwargs)

            sd.makedirs = spy_makedirs  # type: ignore[assignment]
            made = sd.makedirs_once(targets, timeout=30)
            sd.makedirs = real_makedirs  # type: ignore[assignment]
            info = sd.rank_info()
            result: dict[str, Any] = {
                "info": info,
                "made": [str(p) for p in made],
                "exist": all(p.is_dir() for p in targets),
                "seen_at_makedirs": seen_at_makedirs,
            }
            if rank == 1:
                never = Path(root, "shared", "never")
                try:
                    sd.wait_for(lambda: sd._is_dir(never), "rank 0's never dir", 0.5, path=never)
                except sd.WaitTimeout as exc:
                    result["timeout"] = pickle.loads(pickle.dumps(exc))
            result["barrier"] = sd.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", result))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@pytest.mark.timeout(120)
def test_torch_distributed_two_ranks(tmp_path: Path) -> None:
    import torch.distributed as dist  # torch is a test dependency: fail, never skip

    assert dist.is_available(), "this torch build has no torch.distributed"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tmp_path / "store"
    procs = [
        ctx.Process(target=_torch_worker, args=(rank, 2, str(store), str(tmp_path), results))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        got = {rank: (status, detail) for rank, status, detail in _collect(results, 2, 90)}
    except queue.Empty:
        pytest.fail("a torch.distributed worker reported nothing within 90 s")
    finally:
        _join_all(procs, 20)
    for rank in (0, 1):
        status, detail = got[rank]
        assert status == "ok", detail
    expected = [str(tmp_path / "shared" / "a" / "b"), str(tmp_path / "shared" / "c")]
    for rank in (0, 1):
        result = got[rank][1]
        info = result["info"]
        assert (info.rank, info.world_size, info.local_rank) == (rank, 2, rank)
        assert info.source == "torch.distributed"
        assert result["made"] == expected and result["exist"]
        assert result["barrier"] is True
    # Rank 0 created; rank 1 only passed the barrier after that, then re-checked cheaply.
    assert got[0][1]["seen_at_makedirs"] == [False, False]
    assert got[1][1]["seen_at_makedirs"] == [True, True]
    exc = got[1][1]["timeout"]
    msg = str(exc)
    assert isinstance(exc, WaitTimeout) and isinstance(exc, TimeoutError)
    assert "rank 0's never dir" in msg and str(tmp_path / "shared" / "never") in msg
    assert "rank 1/2" in msg and "torch.distributed" in msg and exc.rank == 1
    assert "exists now: no" in msg and "a, c" in msg and "shardcache.distributed.makedirs" in msg
    assert [proc.exitcode for proc in procs] == [0, 0]
