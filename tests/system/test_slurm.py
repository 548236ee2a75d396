"""shardcache under a real SLURM: ``srun`` tasks on a one-node cluster on this machine.

The module fixture runs ``scripts/slurm-local`` (installs Debian's SLURM and munge when
missing, about 10 s here; starts the daemons; under a second when they are up). The
module is skipped, with the script's output as the reason, only when SLURM cannot be
brought up (not root, no apt, ...); with ``SHARDCACHE_REQUIRE_SLURM=1`` that is a failure
instead, and ``.ci/run`` sets it (CI runs as root with apt).

Tasks run the venv's python (absolute path) with an explicit environment: PATH with the
venv first, the moto server's ``AWS_*``, and no ``SHARDCACHE_*`` / launcher variables of
the test process. Each task prints one ``SHARDCACHE-TASK <json>`` line.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest
from repo import ROOT

from shardcache import ShardCache
from shardcache.testing import S3Server

SLURM_LOCAL = ROOT / "scripts" / "slurm-local"
SBATCH_EXAMPLE = ROOT / "scripts" / "sbatch-example.sh"
PYTHON = sys.executable  # the venv's python: not resolved, so the venv stays active
VENV_BIN = Path(sys.executable).parent
SETUP_TIMEOUT = 300  # a first install on a fresh machine takes ~10-30 s
JOB_TIMEOUT = 120  # one srun / sbatch --wait
NTASKS = 4
TAG = "SHARDCACHE-TASK "
BUCKET = "slurm-data"
NSHARDS = 12
SPEC = f"s3://{BUCKET}/train-{{000000..{NSHARDS - 1:06d}}}.tar"
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")

# Setup (a first install) counts against the first test's timeout.
pytestmark = pytest.mark.timeout(SETUP_TIMEOUT + 2 * JOB_TIMEOUT)


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def slurm() -> str:
    """A running one-node SLURM cluster (``scripts/slurm-local``); returns the node name."""
    required = os.environ.get("SHARDCACHE_REQUIRE_SLURM") == "1"
    unavailable = pytest.fail if required else pytest.skip
    if shutil.which("bash") is None:
        unavailable("SLURM tests need bash to run scripts/slurm-local")
    try:
        proc = subprocess.run(
            ["bash", str(SLURM_LOCAL)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SETUP_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        unavailable(f"scripts/slurm-local did not finish in {SETUP_TIMEOUT}s: {_text(exc)}")
    if proc.returncode != 0:
        root = "" if os.geteuid() == 0 else "needs root (to install and start SLURM): "
        unavailable(
            f"{root}SLURM could not be started: scripts/slurm-local exited {proc.returncode}:\n"
            f"{proc.stdout}{proc.stderr}"
        )
    for tool in ("srun", "sbatch", "scancel"):
        if shutil.which(tool) is None:
            unavailable(f"scripts/slurm-local succeeded but {tool} is not on PATH")
    return os.uname().nodename.split(".")[0]


@pytest.fixture
def data(s3: S3Server) -> dict[str, bytes]:
    """``NSHARDS`` shards of distinct pseudo-random bytes in the (reset) S3 server."""
    objects = {
        f"train-{i:06d}.tar": random.Random(i).randbytes(20_000 + 1000 * i) for i in range(NSHARDS)
    }
    s3.put_objects(BUCKET, objects)
    s3.clear_requests()
    return {f"s3://{BUCKET}/{key}": body for key, body in objects.items()}


def _text(exc: subprocess.TimeoutExpired) -> str:
    out = [
        s.decode(errors="replace") if isinstance(s, bytes) else s or ""
        for s in (exc.stdout, exc.stderr)
    ]
    return "".join(out)


def task_env(s3: S3Server | None = None, **extra: str) -> dict[str, str]:
    """The tasks' environment: ours minus shardcache/launcher settings, venv first on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHARDCACHE_", "SLURM_", "AWS_")) and k not in _LAUNCHER_VARS
    }
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONUNBUFFERED"] = "1"
    if s3 is not None:
        env.update(s3.env())
    env.update(extra)
    return env


def run_job(
    cmd: list[str], env: Mapping[str, str], cwd: Path, name: str, timeout: float = JOB_TIMEOUT
) -> str:
    """Run an ``srun`` / ``sbatch`` command line (bounded by ``timeout``); return its stdout.

    On a timeout the job is cancelled by its unique name, so nothing outlives the test.
    """
    try:
        proc = subprocess.run(
            cmd,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        cancel_job(name, env)
        pytest.fail(f"{cmd[0]} did not finish in {timeout:g}s: {' '.join(cmd)}\n{_text(exc)}")
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def cancel_job(name: str, env: Mapping[str, str], wait: float = 30.0) -> None:
    """Cancel the job called ``name`` and wait (bounded) until it has left the queue.

    A job still completing after ``wait`` seconds has a hung ``slurmstepd`` (seen once a
    test cancelled a job on a heavily loaded machine: its nodes stayed "completing" and
    every later job pended until it timed out); it is ended as an administrator would (as
    scripts/slurm-local does at start): its step daemons killed, its nodes set down and
    resumed, so that the next test finds them idle."""
    subprocess.run(["scancel", f"--name={name}"], env=dict(env), timeout=30, check=False)
    deadline = time.monotonic() + wait
    while jobs := _queued(name, env):
        if time.monotonic() > deadline:
            for job, nodes in jobs:
                _end_stuck(job, nodes, env)
            return
        time.sleep(0.2)  # poll interval of a bounded wait, not a synchronisation


def _end_stuck(job: str, nodes: str, env: Mapping[str, str]) -> None:
    """Kill ``job``'s step daemons; set its ``nodes`` (if any) down, then resume them."""
    subprocess.run(["pkill", "-KILL", "-f", rf"^slurmstepd: \[{job}\."], check=False)
    updates = [["state=down", "reason=stuck_completing"], ["state=resume"]] if nodes else []
    for update in updates:
        subprocess.run(
            ["scontrol", "update", f"nodename={nodes}", *update],
            env=dict(env),
            capture_output=True,
            timeout=30,
            check=False,
        )


def _queued(name: str, env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(id, nodes) of each job called ``name`` still in the queue (completing ones too)."""
    proc = subprocess.run(
        ["squeue", "--noheader", f"--name={name}", "--format=%i %N"],
        env=dict(env),  # SLURM_CONF: the cluster the job was submitted to
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    jobs = (line.strip().partition(" ") for line in proc.stdout.splitlines() if line.strip())
    return [(job, nodes.strip()) for job, _, nodes in jobs]


# Final job states (scontrol's JobState); COMPLETING is not final: output may be unflushed.
_FINAL_STATES = frozenset(
    [
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
    ]
)


def sbatch_and_wait(args: list[str], env: Mapping[str, str], cwd: Path) -> tuple[str, str]:
    """Submit a batch job and poll (bounded) until it ends; returns (state, exit code).

    Like ``sbatch --wait``, but polling ``scontrol show job`` every 0.1 s: ``sbatch
    --wait`` polls with a back-off and returns up to 10 s after the job ended.
    (The job record stays ``MinJobAge`` = 60 s after the end, see scripts/slurm-local.)
    """
    name = f"shardcache-test-{uuid.uuid4().hex[:12]}"
    out = run_job(["sbatch", "--parsable", f"--job-name={name}", *args], env, cwd, name)
    job_id = out.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    fields: dict[str, str] = {}
    while True:
        proc = subprocess.run(
            ["scontrol", "--oneliner", "show", "job", job_id],
            env=dict(env),  # SLURM_CONF: the cluster the job was submitted to
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        fields = dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)
        if fields.get("JobState") in _FINAL_STATES:
            return fields["JobState"], fields.get("ExitCode", "?")
        if time.monotonic() > deadline:
            cancel_job(name, env)
            pytest.fail(f"batch job {job_id} did not end in {JOB_TIMEOUT}s: {proc.stdout}")
        time.sleep(0.1)  # poll interval of a bounded wait, not a synchronisation


def srun(args: list[str], env: Mapping[str, str], cwd: Path, ntasks: int = NTASKS) -> str:
    """``srun -n <ntasks> --overcommit`` on the one node; returns the tasks' stdout."""
    name = f"shardcache-test-{uuid.uuid4().hex[:12]}"
    cmd = [
        "srun",
        f"--ntasks={ntasks}",
        "--nodes=1",
        "--overcommit",
        "--time=2",
        f"--job-name={name}",
        "--kill-on-bad-exit=1",
        f"--chdir={cwd}",
        *args,
    ]
    return run_job(cmd, env, cwd, name)


# ``emit(**record)`` in a task: one JSON record on stdout, as lines ``TAG pid index count
# part`` of at most 800 characters. srun forwards a task's output a line at a time, but
# splits lines longer than 1 KiB, and the pieces then interleave with other tasks' lines.
EMIT = f"""\
import json, os, sys
TAG = {TAG!r}
def emit(**record):
    text = json.dumps(record, default=str)
    parts = [text[i : i + 800] for i in range(0, len(text), 800)]
    sys.stdout.write("".join(
        f"{{TAG}}{{os.getpid()}} {{i}} {{len(parts)}} {{p}}\\n" for i, p in enumerate(parts)
    ))
    sys.stdout.flush()
"""


def task_records(stdout: str, expected: int = NTASKS) -> list[dict]:
    """The tasks' ``emit`` records, sorted by rank; exactly ``expected`` of them."""
    parts: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for line in stdout.splitlines():
        if line.startswith(TAG):
            pid, index, count, part = line[len(TAG) :].split(" ", 3)
            parts.setdefault(pid, {})[int(index)] = part
            counts[pid] = int(count)
    records = []
    for pid, got in parts.items():
        assert sorted(got) == list(range(counts[pid])), f"task {pid}: lines missing:\n{stdout}"
        records.append(json.loads("".join(got[i] for i in range(counts[pid]))))
    assert len(records) == expected, f"expected {expected} task records, got:\n{stdout}"
    return sorted(records, key=lambda r: r["rank"])


def python_task(code: str) -> list[str]:
    """srun arguments running ``code`` in the venv's python, after a standard prelude."""
    prelude = (
        "import hashlib\n"
        "from shardcache import ShardCache\n"
        "from shardcache._config.settings import Settings\n"
    )
    return [PYTHON, "-c", EMIT + prelude + code]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def gets_per_shard(s3: S3Server) -> dict[str, int]:
    """Server-side GET count of every shard key."""
    return {
        f"train-{i:06d}.tar": s3.count("GET", BUCKET, f"train-{i:06d}.tar") for i in range(NSHARDS)
    }


# ---------------------------------------------------------------------------- tests
def test_rank_detection_from_srun(slurm: str, tmp_path: Path) -> None:
    code = (
        "from dataclasses import asdict\n"
        "from shardcache.distributed import rank_info\n"
        "s = Settings.resolve()\n"
        "emit(rank=s.rank, local_rank=s.local_rank, world_size=s.world_size,\n"
        "     node_rank=s.node_rank, job_id=s.job_id, sources=dict(s.sources),\n"
        "     info=asdict(rank_info()))\n"
    )
    records = task_records(srun(python_task(code), task_env(), tmp_path))

    assert [r["rank"] for r in records] == list(range(NTASKS))
    assert [r["local_rank"] for r in records] == list(range(NTASKS))
    assert {r["world_size"] for r in records} == {NTASKS}
    assert {r["node_rank"] for r in records} == {0}
    job_ids = {r["job_id"] for r in records}
    assert len(job_ids) == 1 and next(iter(job_ids)).isdigit(), job_ids
    for r in records:
        assert r["sources"]["rank"] == "env SLURM_PROCID (slurm)"
        assert r["sources"]["world_size"] == "env SLURM_NTASKS (slurm)"
        assert r["info"] == {
            "rank": r["rank"],
            "local_rank": r["local_rank"],
            "world_size": NTASKS,
            "local_world_size": NTASKS,
            "node_rank": 0,
            "job_id": r["job_id"],
            "source": "slurm",
        }


@pytest.mark.parametrize("scope", ["rank", "node"])
def test_scope_dir_per_task(slurm: str, tmp_path: Path, scope: str) -> None:
    cache_dir = tmp_path / "cache"
    code = (
        "cache = ShardCache(cache_dir=sys.argv[1])\n"
        "emit(rank=cache.settings.rank, scope_dir=str(cache.settings.scope_dir))\n"
    )
    env = task_env(SHARDCACHE_SCOPE=scope) if scope == "node" else task_env()
    records = task_records(srun([*python_task(code), str(cache_dir)], env, tmp_path))

    if scope == "rank":
        expected = [str(cache_dir / f"rank-{r}") for r in range(NTASKS)]
    else:
        expected = [str(cache_dir / "node")] * NTASKS
    assert [r["scope_dir"] for r in records] == expected


@pytest.mark.parametrize(("scope", "gets_each"), [("node", 1), ("rank", NTASKS)])
def test_every_task_fetches_every_shard(
    slurm: str, tmp_path: Path, s3: S3Server, data: dict[str, bytes], scope: str, gets_each: int
) -> None:
    """4 tasks fetch all 12 shards (each starting at a different one, so they collide).

    Node scope: one cache for the node, so each shard is downloaded exactly once however
    many tasks want it. Rank scope: every rank has its own directory, so each rank
    downloads its own copy (4 GETs per shard): use node scope (or split the shards) when
    ranks read the same data.
    """
    cache_dir = tmp_path / "cache"
    code = (
        "urls = sys.argv[2:]\n"
        "cache = ShardCache(cache_dir=sys.argv[1])\n"
        "r = cache.settings.rank\n"
        "order = urls[r * 3:] + urls[:r * 3]\n"
        "digests = {u: hashlib.sha256(cache.fetch(u).read_bytes()).hexdigest() for u in order}\n"
        "# One short line per task: srun may interleave the tasks' lines past 1 KiB.\n"
        "digests = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()\n"
        "emit(rank=r, scope_dir=str(cache.settings.scope_dir), digests=digests,\n"
        "     stats=cache.stats().as_dict())\n"
    )
    env = task_env(s3, SHARDCACHE_SCOPE=scope)
    records = task_records(srun([*python_task(code), str(cache_dir), *data], env, tmp_path))

    expected = {url: sha256(body) for url, body in data.items()}
    expected_digest = sha256(json.dumps(expected, sort_keys=True).encode())
    for r in records:
        assert r["digests"] == expected_digest, f"rank {r['rank']} read different bytes"
    assert gets_per_shard(s3) == dict.fromkeys(gets_per_shard(s3), gets_each)
    if scope == "node":
        assert {r["scope_dir"] for r in records} == {str(cache_dir / "node")}
        assert sum(r["stats"]["misses"] for r in records) == NSHARDS
    else:
        assert [r["scope_dir"] for r in records] == [
            str(cache_dir / f"rank-{i}") for i in range(NTASKS)
        ]
        assert [r["stats"]["misses"] for r in records] == [NSHARDS] * NTASKS


def _cached(cache_dir: Path, scope: str, rank: int = 0) -> set[str]:
    """URLs of the test data with a complete copy in that scope's directory."""
    cache = ShardCache(cache_dir, scope=scope, rank=rank, world_size=NTASKS)
    return {u for u in _urls() if cache.contains(u)}


def _urls() -> list[str]:
    return [f"s3://{BUCKET}/train-{i:06d}.tar" for i in range(NSHARDS)]


def test_warm_split_auto_rank_scope(
    slurm: str, tmp_path: Path, s3: S3Server, data: dict[str, bytes]
) -> None:
    """Rank r warms shards[r::4] into rank-r: each shard downloaded once, by its reader."""
    cache_dir = tmp_path / "cache"
    shardcache_bin = str(VENV_BIN / "shardcache")
    args = [shardcache_bin, "warm", SPEC, "--split", "auto", "--cache-dir", str(cache_dir)]
    srun(args, task_env(s3, SHARDCACHE_SCOPE="rank"), tmp_path)

    assert gets_per_shard(s3) == dict.fromkeys(gets_per_shard(s3), 1)
    urls = _urls()
    for rank in range(NTASKS):
        assert _cached(cache_dir, "rank", rank) == set(urls[rank::NTASKS]), f"rank-{rank}"
    assert sorted(p.name for p in cache_dir.iterdir()) == [f"rank-{r}" for r in range(NTASKS)]
    for url, body in data.items():
        rank = urls.index(url) % NTASKS
        path = ShardCache(cache_dir, scope="rank", rank=rank, world_size=NTASKS).path_for(url)
        assert path.read_bytes() == body


def test_warm_split_auto_node_scope(
    slurm: str, tmp_path: Path, s3: S3Server, data: dict[str, bytes]
) -> None:
    """Local rank 0 warms the node's shards (here: all) into <dir>/node; others do nothing."""
    cache_dir = tmp_path / "cache"
    shardcache_bin = str(VENV_BIN / "shardcache")
    args = [shardcache_bin, "warm", SPEC, "--split", "auto", "--cache-dir", str(cache_dir)]
    srun(args, task_env(s3, SHARDCACHE_SCOPE="node"), tmp_path)

    assert gets_per_shard(s3) == dict.fromkeys(gets_per_shard(s3), 1)
    assert _cached(cache_dir, "node") == set(_urls())
    assert [p.name for p in cache_dir.iterdir()] == ["node"]
    cache = ShardCache(cache_dir, scope="node")
    for url, body in data.items():
        assert cache.path_for(url).read_bytes() == body


# The training command of the sbatch test: reads its split_by_node share through the cache.
TRAIN_CHECK = (
    EMIT
    + """\
import hashlib
import shardcache
from shardcache import ShardCache, expand_urls
from shardcache.distributed import rank_info

info = rank_info()
shards = ({"url": u} for u in expand_urls(os.environ["SHARDS"]))
urls = [s["url"] for s in shardcache.split_by_node(shards)]
cache = ShardCache()
cached_before = {u: cache.contains(u) for u in urls}
digests = {u: hashlib.sha256(cache.fetch(u).read_bytes()).hexdigest() for u in urls}
emit(
    rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
    scope_dir=str(cache.settings.scope_dir), cached_before=cached_before, digests=digests,
    master=os.environ.get("MASTER_ADDR"))
"""
)


def test_sbatch_example_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SBATCH_EXAMPLE)], check=True, timeout=30)


def submit_template(
    tmp_path: Path, env: Mapping[str, str], nodes: int, per_node: int
) -> tuple[str, list[dict]]:
    """The documented sbatch template, submitted to its end with ``nodes`` x ``per_node``
    tasks of 1 CPU: its log and the training tasks' records (it must have completed).

    Overridden for this machine: no GPU line (the local clusters have no GPUs), and the
    training command replaced by ``TRAIN_CHECK``.
    """
    script = tmp_path / "job.sh"
    lines = SBATCH_EXAMPLE.read_text().splitlines(keepends=True)
    script.write_text("".join(ln for ln in lines if not ln.startswith("#SBATCH --gpus")))
    train = tmp_path / "train_check.py"
    train.write_text(TRAIN_CHECK)
    out = tmp_path / "job.out"
    args = [
        f"--nodes={nodes}",
        f"--ntasks-per-node={per_node}",
        "--cpus-per-task=1",
        "--time=2",
        f"--output={out}",
        str(script),
    ]
    state, exit_code = sbatch_and_wait(args, {**env, "TRAIN_CMD": f"{PYTHON} {train}"}, tmp_path)
    log = out.read_text() if out.exists() else "(no output file)"
    assert (state, exit_code) == ("COMPLETED", "0:0"), log
    return log, task_records(log, expected=nodes * per_node)


def check_all_hits(records: list[dict], scope_dir: str, data: dict[str, bytes], log: str) -> None:
    """``TRAIN_CHECK`` records: every read was a hit of the right bytes in ``scope_dir``,
    and the tasks' shares cover the data exactly once."""
    read: list[str] = []
    for r in records:
        assert r["scope_dir"] == scope_dir
        assert r["cached_before"] == dict.fromkeys(r["digests"], True), log
        assert all(sha256(data[u]) == d for u, d in r["digests"].items())
        read += r["digests"]
    assert sorted(read) == sorted(data), "the ranks' shares do not cover the data exactly once"


def test_sbatch_example_warms_then_trains_from_cache(
    slurm: str, tmp_path: Path, s3: S3Server, data: dict[str, bytes]
) -> None:
    """The example job, submitted with ``sbatch`` on the one-node cluster (``min(nproc,
    4)`` tasks), to its end: the warm step fetched exactly what the training ranks read,
    once each, so every read is a hit."""
    ntasks = min(os.cpu_count() or 1, 4)
    env = task_env(s3, SHARDS=SPEC, SLURM_TMPDIR=str(tmp_path))
    log, records = submit_template(tmp_path, env, nodes=1, per_node=ntasks)
    user = os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name
    assert [r["rank"] for r in records] == list(range(ntasks))
    assert {r["master"] for r in records} == {slurm}
    check_all_hits(records, str(tmp_path / f"shardcache-{user}" / "node"), data, log)
    assert gets_per_shard(s3) == dict.fromkeys(gets_per_shard(s3), 1)


def _hung_job(env: Mapping[str, str], name: str) -> str:
    """A running one-task job whose step daemons are stopped (SIGSTOP), then cancelled: it
    stays "completing", as after a slurmstepd hang. Returns its id."""
    proc = subprocess.Popen(
        ["srun", "--ntasks=1", "--time=2", f"--job-name={name}", "sleep", "300"],
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (steps := _step_daemons(name, env)):
        assert proc.poll() is None, "srun ended before its step started"
        assert time.monotonic() < deadline, "the job's step never started"
        time.sleep(0.1)  # poll interval of a bounded wait, not a synchronisation
    job, pids = steps
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    subprocess.run(["scancel", job], env=dict(env), timeout=30, check=True)
    deadline = time.monotonic() + 30
    while _queued(name, env) and _job_state(job, env) != "CG":
        assert time.monotonic() < deadline, "the cancelled job never reached 'completing'"
        time.sleep(0.1)  # poll interval of a bounded wait, not a synchronisation
    proc.kill()
    proc.wait(30)
    return job


def _step_daemons(name: str, env: Mapping[str, str]) -> tuple[str, list[int]] | None:
    """The job called ``name`` and the pids of its step's slurmstepd, once both exist."""
    jobs = _queued(name, env)
    if not jobs:
        return None
    job = jobs[0][0]
    found = subprocess.run(
        ["pgrep", "-f", rf"^slurmstepd: \[{job}\.0\]"], capture_output=True, text=True, check=False
    )
    pids = [int(pid) for pid in found.stdout.split()]
    return (job, pids) if pids else None


def _job_state(job: str, env: Mapping[str, str]) -> str:
    proc = subprocess.run(
        ["squeue", "--noheader", f"--jobs={job}", "--format=%t"],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return proc.stdout.strip()


def test_a_job_stuck_completing_is_ended_by_the_cancel_and_by_slurm_local(
    slurm: str, tmp_path: Path
) -> None:
    """A job whose slurmstepd hangs stays "completing" and blocks its node. The tests' job
    cancel ends it (step daemons killed, node set down and resumed), and so does
    scripts/slurm-local at start; either way the next job runs."""
    env = task_env()
    name = f"shardcache-test-{uuid.uuid4().hex[:12]}"
    job = _hung_job(env, name)
    assert _job_state(job, env) == "CG"
    cancel_job(name, env, wait=2)
    assert _queued(name, env) == []
    assert "hello" in srun([PYTHON, "-c", "print('hello')"], env, tmp_path, ntasks=1)

    name = f"shardcache-test-{uuid.uuid4().hex[:12]}"
    job = _hung_job(env, name)
    assert _job_state(job, env) == "CG"
    up = subprocess.run(
        ["bash", str(SLURM_LOCAL)],
        capture_output=True,
        text=True,
        timeout=SETUP_TIMEOUT,
        check=False,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"job {job} has been completing" in up.stdout + up.stderr
    assert _queued(name, env) == []
    assert "hello" in srun([PYTHON, "-c", "print('hello')"], env, tmp_path, ntasks=1)
