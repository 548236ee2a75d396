"""The ``shardcache`` command: warm (real runs of ``python -m shardcache`` against moto),
the split rule, --version, -v, usage errors and help of every command, evict."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import reserved_port
from repo import ROOT
from slurm_stand_ins import slurm_stand_ins

import shardcache
from shardcache import ShardCache
from shardcache._base.units import format_bytes
from shardcache._cli.main import main
from shardcache.testing import FaultProxy
from shardcache.warm import WarmPlan, plan_warm

BUCKET = "warm"
COMMANDS = ["warm", "status", "clean", "evict", "verify", "config", "demo", "report"]


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m shardcache ARGS`` with the test's environment (AWS_* at moto)."""
    full_env = {**os.environ, "SHARDCACHE_DIR": str(tmp_path / "cache"), **env}
    return subprocess.run(
        [sys.executable, "-m", "shardcache", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def shards(s3):
    objects = {f"train-{i:06d}.tar": random.Random(i).randbytes(50_000 + i) for i in range(8)}
    s3.put_objects(BUCKET, objects)
    return {f"s3://{BUCKET}/{key}": data for key, data in objects.items()}


SPEC = f"s3://{BUCKET}/train-{{000000..000007}}.tar"


# ------------------------------------------------------------------------------- warm


def test_warm_fetches_everything_and_a_second_run_is_all_hits(s3, shards, tmp_path) -> None:
    first = _run(tmp_path, "warm", SPEC, "--threads", "3")
    assert first.returncode == 0, first.stderr
    assert "8 of 8 shards ok, 0 failed (hits 0, misses 8, shared 0)" in first.stdout
    # Not a terminal: plain progress lines, no bar.
    assert "warm: 8/8 shards (0 failed)" in first.stderr
    assert "\r" not in first.stderr
    for key in (url.split("/", 3)[3] for url in shards):
        assert s3.count("GET", BUCKET, key) == 1
    cache = ShardCache(tmp_path / "cache")
    for url, data in shards.items():
        assert cache.path_for(url).read_bytes() == data

    s3.clear_requests()
    second = _run(tmp_path, "warm", SPEC)
    assert second.returncode == 0, second.stderr
    assert "8 of 8 shards ok, 0 failed (hits 8, misses 0, shared 0)" in second.stdout
    assert "0 B downloaded" in second.stdout
    assert s3.count("GET", BUCKET) == 0


def test_warm_lists_failures_and_caches_the_rest(s3, shards, tmp_path) -> None:
    missing = f"s3://{BUCKET}/train-999999.tar"
    manifest = tmp_path / "shards.txt"
    manifest.write_text("# two good, one missing\n" + "\n".join([*list(shards)[:2], missing]))
    result = _run(tmp_path, "warm", "--from-file", str(manifest), list(shards)[2])
    assert result.returncode == 1
    assert "3 of 4 shards ok, 1 failed" in result.stdout
    failed = [line for line in result.stdout.splitlines() if line.startswith(f"  {missing}")]
    assert len(failed) == 1 and "RemoteNotFoundError" in failed[0]
    cache = ShardCache(tmp_path / "cache")
    assert [cache.contains(url) for url in list(shards)[:3]] == [True] * 3
    assert not cache.contains(missing)


def test_warm_groups_failures_by_error_and_lists_all_with_json(s3, shards, tmp_path) -> None:
    missing = [f"s3://{BUCKET}/gone-{i:06d}.tar" for i in range(30)]
    result = _run(tmp_path, "warm", *missing, next(iter(shards)), "--threads", "4")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("warm: 1 of 31 shards ok, 30 failed (hits 0, misses 1")
    assert lines[1:3] == [
        "failed shards (30):",
        "  30 shards: RemoteNotFoundError: <url> does not exist (HTTP 404 NoSuchKey: The "
        "specified key does not exist.); "
        "failed at once, without retries. Check the bucket and key (and the endpoint: "
        "AWS_ENDPOINT_URL / storage_options).",
    ]
    assert lines[3:] == [f"    {url}" for url in missing[:5]] + [
        "    ... and 25 more (--json lists all)"
    ]

    as_json = _run(tmp_path, "warm", *missing, "--json")
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert (report["total"], report["ok"], report["not_attempted"], report["stopped"]) == (
        30,
        0,
        0,
        None,
    )
    assert [f["url"] for f in report["failed"]] == missing
    assert report["plan"] == "every shard, world size 1"


def test_a_missing_bucket_stops_warm_at_once_with_one_error(s3, shards, tmp_path) -> None:
    missing = [f"s3://nobucket/train-{i:06d}.tar" for i in range(60)]
    result = _run(tmp_path, "warm", *missing, "--threads", "2", "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert len(report["failed"]) <= 2 + 1  # the first, and what was in flight beside it
    assert report["not_attempted"] == 60 - len(report["failed"])
    assert report["stopped"].startswith("RemoteNotFoundError is about the store, not one shard")
    errors = {f["error"] for f in report["failed"]}
    assert all("the bucket 'nobucket' does not exist at http://127.0.0.1:" in e for e in errors)
    assert all("(from AWS_ENDPOINT_URL)" in e and "without retries" in e for e in errors)
    assert s3.count(None, "nobucket") <= 3  # one request a shard tried, no retry


def test_a_refused_endpoint_stops_warm_at_once_naming_it(s3, shards, tmp_path) -> None:
    with reserved_port() as port:  # nothing listens there: connections are refused
        endpoint = f"http://127.0.0.1:{port}"
        result = _run(
            tmp_path, "warm", SPEC, "--threads", "2", "--json", "-v", AWS_ENDPOINT_URL=endpoint
        )
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["stopped"].startswith("PermanentFetchError is about the store")
    assert report["not_attempted"] >= 8 - 3
    error = report["failed"][0]["error"]
    assert "the connection was refused by 127.0.0.1" in error and "not retried on loopback" in error
    assert f"requests go to {endpoint} (from AWS_ENDPOINT_URL)" in error
    assert "check that endpoint's host and port" in error
    # No retry (before, 26 s of backoff per shard): every retry is logged, at INFO. Counted,
    # not timed: a time bound on a subprocess is tripped by a loaded machine.
    assert "retrying" not in result.stderr, result.stderr[-3000:]


def test_warm_stops_when_the_same_store_level_error_repeats(s3, shards, tmp_path) -> None:
    # Access denied may be one object's ACL, so a streak of it, not the first, stops the run.
    with FaultProxy("127.0.0.1", s3.port) as proxy:
        proxy.add_fault("status:403", times=None)
        endpoint = f"http://127.0.0.1:{proxy.port}"
        many = [f"s3://{BUCKET}/denied-{i:03d}.tar" for i in range(40)]
        result = _run(tmp_path, "warm", *many, "--threads", "2", AWS_ENDPOINT_URL=endpoint)
    assert result.returncode == 1
    first, stopped, header, group, *_listed = result.stdout.splitlines()
    failed = int(first.split(" failed")[0].rsplit(" ", 1)[1])
    assert header == f"failed shards ({failed}):"
    assert 5 <= failed <= 5 + 2, first  # the streak, and what was in flight
    assert group.startswith(f"  {failed} shards: RemotePermissionError: ")
    assert stopped.startswith(
        "stopped early: 5 shards in a row failed with RemotePermissionError, an error that is "
        "not about one shard"
    )


def test_a_cache_dir_that_is_a_file_fails_warm_once_before_any_download(tmp_path) -> None:
    sources = tmp_path / "src"
    sources.mkdir()
    for i in range(200):
        (sources / f"{i:03d}.tar").write_bytes(b"x" * 100)
    (tmp_path / "cache").write_text("a file where the cache root should be")
    result = _run(tmp_path, "warm", f"{sources}/{{000..199}}.tar", "--threads", "2")
    assert result.returncode == 1
    assert result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("shardcache: CacheDirError: Cannot create cache directory "), last
    assert "a regular file exists at" in last and "NFS" not in last
    assert result.stderr.count("CacheDirError") == 1


def test_warm_stops_after_max_failures(s3, shards, tmp_path) -> None:
    missing = [f"s3://{BUCKET}/gone-{i:03d}.tar" for i in range(40)]
    result = _run(tmp_path, "warm", *missing, "--max-failures", "3", "--threads", "1", "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert len(report["failed"]) == 3 and report["not_attempted"] == 37
    assert report["stopped"] == "3 shards failed (max_failures 3)"
    # Shard errors alone (not found) never stop a run early.
    result = _run(tmp_path, "warm", *missing, "--threads", "1", "--json")
    assert len(json.loads(result.stdout)["failed"]) == 40


def test_warm_json_of_a_task_with_nothing_to_do(tmp_path) -> None:
    env = {"SHARDCACHE_SCOPE": "node", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    result = _run(tmp_path, "warm", "s3://b/x-{0..3}.tar", "--json", **env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["plan"].startswith("local rank 1; local rank 0 warms")
    assert (report["total"], report["failed"], report["stopped"]) == (0, [], None)


def test_warm_rank_scope_under_torchrun_warms_this_ranks_share(s3, shards, tmp_path) -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
    result = _run(tmp_path, "warm", SPEC, **env)
    assert result.returncode == 0, result.stderr
    assert "3 of 3 shards ok" in result.stdout
    mine = list(shards)[1::3]
    cache = ShardCache(tmp_path / "cache", rank=1)
    assert cache.settings.scope_dir == tmp_path / "cache" / "rank-1"
    assert [url for url in shards if cache.contains(url)] == mine
    assert not (tmp_path / "cache" / "rank-0").exists()


def test_warm_node_scope_only_local_rank_0_works(s3, shards, tmp_path) -> None:
    base = {"SHARDCACHE_SCOPE": "node", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    idle = _run(tmp_path, "warm", SPEC, **base, RANK="3", LOCAL_RANK="1", GROUP_RANK="1")
    assert idle.returncode == 0, idle.stderr
    assert idle.stdout.startswith("warm: nothing to do (local rank 1;")
    assert not (tmp_path / "cache" / "node").exists()

    busy = _run(tmp_path, "warm", SPEC, **base, RANK="2", LOCAL_RANK="0", GROUP_RANK="1")
    assert busy.returncode == 0, busy.stderr
    assert "4 of 4 shards ok" in busy.stdout
    cache = ShardCache(tmp_path / "cache", scope="node")
    # Ranks 2 and 3 are on this node: shards 2, 3, 6, 7 of 8 over a world of 4.
    expected = [url for i, url in enumerate(shards) if i % 4 in (2, 3)]
    assert [url for url in shards if cache.contains(url)] == expected


URLS = [f"u{i}" for i in range(10)]


def _plan(**kw: object) -> WarmPlan:
    args = {"split": "auto", "scope": "rank", "rank": 0, "world_size": 1, "local_rank": 0}
    args.update(kw)
    args.setdefault("local_world_size", None)
    return plan_warm(URLS, **args)  # type: ignore[arg-type]


def test_split_rank_scope_gives_each_rank_what_split_by_node_gives_it() -> None:
    from shardcache._datasets.wds import split_by_node

    shares = []
    for rank in range(4):
        plan = _plan(rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2)
        env = {"RANK": str(rank), "WORLD_SIZE": "4"}
        with pytest.MonkeyPatch.context() as mp:
            for name, value in env.items():
                mp.setenv(name, value)
            assert plan.urls == list(split_by_node(URLS))
        assert plan.active
        shares.append(plan.urls)
    assert sorted(url for share in shares for url in share) == sorted(URLS)


def test_split_node_scope_unions_the_contiguous_ranks_of_the_node() -> None:
    node0 = _plan(scope="node", rank=0, world_size=6, local_rank=0, local_world_size=3)
    node1 = _plan(scope="node", rank=3, world_size=6, local_rank=0, local_world_size=3)
    assert node0.urls == ["u0", "u1", "u2", "u6", "u7", "u8"]
    assert node1.urls == ["u3", "u4", "u5", "u9"]
    others = _plan(scope="node", rank=4, world_size=6, local_rank=1, local_world_size=3)
    assert (others.active, others.urls) == (False, [])
    # Nodes of different sizes (SLURM_TASKS_PER_NODE=3,2): node 1 holds ranks 3..4.
    uneven = _plan(scope="node", rank=3, world_size=5, local_rank=0, local_world_size=2)
    assert uneven.urls == ["u3", "u4", "u8", "u9"]


def test_split_node_scope_with_unknown_local_size_local_rank_0_warms_all() -> None:
    plan = _plan(scope="node", rank=2, world_size=4, local_rank=0, local_world_size=None)
    assert plan.active and plan.urls == URLS
    assert not _plan(scope="node", rank=3, world_size=4, local_rank=1).active


def test_split_none_and_world_size_1_warm_everything() -> None:
    assert _plan(split="none", rank=2, world_size=4, local_rank=2).urls == URLS
    assert _plan(split="none", scope="node", rank=2, world_size=4, local_rank=2).active
    assert _plan(world_size=1).urls == URLS
    assert _plan(scope="node", world_size=1).urls == URLS
    with pytest.raises(ValueError, match="split"):
        _plan(split="sometimes")


# ------------------------------------------------------------------------ usage, help


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    assert f"  shardcache {command}" in out or f" shardcache {command} " in out


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_the_installed_distributions(flag: str, tmp_path) -> None:
    """The console script and ``python -m shardcache`` print the one version: the
    package's ``__version__``, which the installed metadata (from pyproject) agrees with."""
    script = Path(sys.executable).parent / "shardcache"
    for argv in ([str(script), flag], [sys.executable, "-m", "shardcache", flag]):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"shardcache {shardcache.__version__}\n"
        assert result.stderr == ""
    assert shardcache.__version__ == importlib.metadata.version("shardcache")


def test_verbose_before_or_after_the_command(tmp_path) -> None:
    shard = tmp_path / "a.tar"
    shard.write_bytes(random.Random(0).randbytes(10_000))
    runs = {
        "before": ["-v", "warm", str(shard)],
        "after": ["warm", str(shard), "-v"],
        "long": ["warm", "--verbose", str(shard)],
        "none": ["warm", str(shard)],
    }
    for name, argv in runs.items():
        result = _run(tmp_path, *argv, "--cache-dir", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
        assert (" DEBUG " in result.stderr) == (name != "none"), (argv, result.stderr)


BAD_ARGS = [
    ["warm"],
    ["warm", "s3://b/x-{1..", "--threads", "2"],
    ["warm", "s3://b/x.tar", "--threads", "0"],
    ["warm", "s3://b/x.tar", "--split", "sometimes"],
    ["warm", "--from-file", "/nonexistent/shards.txt"],
    ["status", "--bogus"],
    ["status", "--rank", "-1"],
    ["clean", "extra"],
    ["evict"],
    ["evict", "--max-bytes", "12Q"],
    ["verify", "--manifest", "/nonexistent/manifest.json"],
    ["verify", "--threads", "many"],
    ["config", "--yaml"],
    ["demo", "--shards", "x"],
    ["report"],
    ["report", "/nonexistent/metrics"],
    ["report", "/", "--top", "-1"],
    ["report", "/", "--epoch", "first"],
    ["report", "/", "--plot", "/nonexistent/dir/wait.png"],
    ["frobnicate"],
]


@pytest.mark.parametrize("argv", BAD_ARGS, ids=[" ".join(a) for a in BAD_ARGS])
def test_bad_arguments_give_one_line_and_exit_2(argv: list[str], tmp_path, capsys) -> None:
    try:
        code = main([*argv, "--cache-dir", str(tmp_path)] if argv[0] == "verify" else argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("shardcache")
    assert captured.out == ""


def test_usage_error_from_a_real_process(tmp_path) -> None:
    result = _run(tmp_path, "warm", "--threads", "2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "shardcache warm: error: give at least one SPEC or --from-file F "
        "(see shardcache warm --help)"
    ]


# ------------------------------------------------------------------------------ evict


def test_evict_cli_reduces_the_cache_to_the_size(s3, shards, tmp_path) -> None:
    assert _run(tmp_path, "warm", SPEC).returncode == 0
    cache = ShardCache(tmp_path / "cache")
    before = sum(e.size for e in cache.entries())
    limit = before // 2 + 100  # exactly 4 of the 8 (sizes 50000..50007) must go
    result = _run(tmp_path, "evict", "--max-bytes", str(limit))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"evict {cache.settings.scope_dir} to ")
    assert "removed 4 shards" in result.stdout
    after = cache.entries()
    assert sum(e.size for e in after) <= limit
    assert len(after) == 4

    as_json = _run(tmp_path, "evict", "--json", SHARDCACHE_MAX_BYTES="1K")
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert (len(report["removed"]), report["kept_bytes"], report["in_use"]) == (4, 0, 0)
    assert all(item["url"].startswith(f"s3://{BUCKET}/") for item in report["removed"])
    assert cache.entries() == []


def _on_terminal(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """``python -m shardcache ARGS`` with stderr on a terminal (120 columns): its exit code,
    stdout and what it drew on the terminal."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, "SHARDCACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcache", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=follower,
    )
    os.close(follower)
    err = b""
    while True:  # until the child closes the terminal (EIO) or exits
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    os.close(leader)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out.decode(), err.decode()


def test_warm_draws_a_progress_bar_on_a_terminal(s3, shards, tmp_path) -> None:
    code, out, bar = _on_terminal(tmp_path, "warm", SPEC)
    assert code == 0
    assert "warm: 100%|" in bar and "8/8 [" in bar and "MB/s" in bar
    assert "8 of 8 shards ok" in out


def test_verify_shows_progress_on_a_terminal_and_lines_elsewhere(s3, shards, tmp_path) -> None:
    assert _run(tmp_path, "warm", SPEC).returncode == 0
    code, out, bar = _on_terminal(tmp_path, "verify")
    assert code == 0, bar
    assert "verify: 100%|" in bar and "8/8 [" in bar
    assert out.startswith("verify ") and "8 shards, 8 ok" in out
    plain = _run(tmp_path, "verify", "--json")
    assert plain.returncode == 0, plain.stderr
    assert "\r" not in plain.stderr
    (last,) = [line for line in plain.stderr.splitlines() if line.startswith("verify: 8/8")]
    size = format_bytes(sum(len(data) for data in shards.values()))
    assert last.startswith(f"verify: 8/8 shards (0 failed), {size} checked, ")
    assert last.endswith(", done")
    assert json.loads(plain.stdout)["counts"]["ok"] == 8


@pytest.mark.timeout(180)
def test_demo_shows_progress_and_reports_json(tmp_path) -> None:
    args = ("demo", "--shards", "2", "--workers", "0", "--cache-dir", str(tmp_path / "demo"))
    code, out, bar = _on_terminal(tmp_path, *args)
    assert code == 0, bar
    assert "demo: starting an embedded S3 server and writing 2 shards" in bar
    assert "demo: 100%|" in bar and "64/64 [" in bar
    assert "hits       0" in out
    plain = _run(tmp_path, *args, "--json")
    assert plain.returncode == 0, plain.stderr
    assert "\r" not in plain.stderr
    assert plain.stderr.splitlines()[-1].startswith("demo: 64/64 samples, elapsed ")
    report = json.loads(plain.stdout)
    assert (report["shards"], report["hits"], report["samples"], report["failed"]) == (2, 2, 64, [])


@pytest.mark.timeout(90)
def test_interrupted_warm_exits_130_and_leaves_no_temp_file(s3, tmp_path) -> None:
    s3.put_objects(BUCKET, {"huge.tar": random.Random(1).randbytes(48 << 20)})
    # Through a 4 MB/s link the download takes 12 s, so the SIGINT sent once its temp file
    # exists always lands mid-download (unshaped, a quiet machine finished it first).
    proxy = FaultProxy("127.0.0.1", s3.port, total_rate=4_000_000).start()
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
        "SHARDCACHE_DIR": str(tmp_path / "cache"),
        "SHARDCACHE_CHUNK_SIZE": "64KiB",  # a progress report (and chance to stop) per 64 KiB
    }
    # SIGINT as a terminal's Ctrl-C gives it, whatever this process passes on: an ignored
    # SIGINT (a shell's background job; children inherit SIG_IGN, which Python keeps) or a
    # blocked one (a signal mask survives exec).
    interruptible = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
        "runpy.run_module('shardcache', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", interruptible, "warm", f"s3://{BUCKET}/huge.tar"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    data_dir = tmp_path / "cache" / "rank-0" / "data"
    try:
        # The download has started once its temp file exists (bounded poll of the disk).
        deadline = time.monotonic() + 30
        while not list(data_dir.glob("*/*.part")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the download never started"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proxy.stop()
    assert proc.returncode == 130, err
    assert err.rstrip().endswith("shardcache: interrupted by SIGINT (exit 130)")
    assert [p for p in data_dir.rglob("*") if not p.is_dir()] == []  # no .part, no shard


# ------------------------------------------------------------------ the sbatch template


def test_sbatch_template_gives_the_warm_threads_to_the_warm_step_alone(tmp_path) -> None:
    """scripts/sbatch-example.sh run by bash with stand-ins for srun and scontrol that
    record each step's arguments and environment (tests/system/test_slurm.py submits it to a
    real cluster)."""
    bin_dir, steps = slurm_stand_ins(tmp_path)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STEPS": str(steps),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NTASKS": "8",
        "SHARDS": "s3://b/train-{0..9}.tar",
        "SLURM_TMPDIR": str(tmp_path),
    }
    script = ROOT / "scripts" / "sbatch-example.sh"
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60, capture_output=True)
    warm_args, train_args = ((steps / f"{n}.args").read_text().split("\n") for n in (0, 1))
    assert warm_args[:4] == ["--kill-on-bad-exit=1", "shardcache", "warm", env["SHARDS"]]
    assert warm_args[4:8] == ["--split", "auto", "--threads", "16"]
    assert train_args[1:3] == ["python", "train.py"]
    for n in (0, 1):
        step_env = (steps / f"{n}.env").read_text().splitlines()
        assert "SHARDCACHE_SCOPE=node" in step_env
        assert not [v for v in step_env if v.startswith("SHARDCACHE_THREADS=")]
    subprocess.run(["bash", str(script)], env={**env, "WARM_THREADS": "32"}, check=True, timeout=60)
    assert (steps / "2.args").read_text().split("\n")[6:8] == ["--threads", "32"]
