"""A SLURM job at its time limit: SLURM's signal, a checkpoint, a requeue, the exact epoch.

tests/support/resume_job.py runs as a batch job on the one-node cluster of
``scripts/slurm-local`` (the ``slurm`` fixture of tests/system/test_slurm.py, imported: this
module is skipped, or fails under ``SHARDCACHE_REQUIRE_SLURM=1``, exactly as that one is).
The job reads a ``ResumableDataset`` through a ``StatefulDataLoader`` (2 workers) and, at
batch ``WAIT_AT``, waits (event-driven, bounded) for SIGUSR1, as a job that is about to
reach its time limit would. SLURM itself sends the signal (``--signal``); the test sends
none. The job saves ``ckpt-signal``, runs ``scontrol requeue`` and exits; the requeued job
(``SLURM_RESTART_COUNT=1``) resumes from the checkpoint and finishes. The batches of the
first run up to its checkpoint, then those of the second, must be the batches of an
uninterrupted run: the reference, run directly with the venv's python while the job waits
for its signal.

The SLURM configuration (SLURM 22.05; each point checked on the local cluster):

- ``--signal=B:USR1@20`` and ``exec python``. With ``B:``, slurmstepd signals only the
  batch script's process (``kill(pid)``, not its process group), and ``exec`` makes the
  training process that process: SIGUSR1 reaches the python main process and nothing
  else. Without ``B:`` SLURM signals only job steps (``srun``): the batch script is not
  one, so a python it starts directly never sees the signal; under ``srun`` it would,
  but so would every process of the step, the DataLoader workers included.
- ``--time=1``: the limit is kept in whole minutes (``--time=0:40`` is a minute too).
  slurmctld checks limits every 30 s (``PERIODIC_TIMEOUT``) and sends the warning at the
  first check where ``now + 20 + 30 >= end``: 10-40 s after the start, never earlier.
  The job installs its handler about 3 s after its start (a SIGUSR1 before would kill
  python) and reaches batch ``WAIT_AT`` after 3-7 s; should the signal come before
  that, the checkpoint follows an earlier batch, mid-epoch still. A larger ``@`` would
  signal sooner on average, but could kill python while it imports torch.
- ``--requeue``; ``--open-mode=append`` keeps both runs' output in one file.
- A requeued batch job gets ``BeginTime`` = the end of its cleanup + the launch
  credential's lifetime + 1 s (slurmctld's ``batch_requeue_fini``; slurmd refuses a
  credential no newer than the revoked one), 121 s here. Once the job is ``PENDING``
  again (that cleanup done) and the clock is past the requeue's second, the test sets
  ``StartTime=now``. It also raises that job's ``TimeLimit``: SLURM re-arms the warning
  on a requeue, and the second run (about 5 s) must not get its own SIGUSR1 10 s after
  its start on a slow machine (a real job would just checkpoint and requeue again).

Time: 25-55 s, mostly the wait for the signal (10-40 s after the job starts).
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from repo import SUPPORT
from tars import shard_samples, tar_bytes
from test_slurm import (
    _FINAL_STATES,
    PYTHON,
    SETUP_TIMEOUT,
    slurm,  # noqa: F401 (the module fixture: skipped or failed as test_slurm's tests)
    task_env,
)

from shardcache.testing import S3Server

JOB_SCRIPT = SUPPORT / "resume_job.py"
BUCKET = "resume-slurm"
NSHARDS, PER_SHARD = 8, 13
SPEC = f"s3://{BUCKET}/train-{{000000..{NSHARDS - 1:06d}}}.tar"
EPOCHS = 2
WAIT_AT = 5  # the batch at which the first run waits for SLURM's signal
TIME_LIMIT = 1  # minutes (--time)
WARN = 20  # seconds (--signal=B:USR1@WARN): sent 10-40 s after the start, see above
PERIODIC = 30  # slurmctld's time-limit check interval (PERIODIC_TIMEOUT)
SECOND_TIME_LIMIT = 5  # minutes, for the requeued job
RUN_TIMEOUT = 60  # the reference run
FLOW_TIMEOUT = 150  # submit -> signal -> requeue -> second run completed
POLL = 0.1

pytestmark = pytest.mark.timeout(SETUP_TIMEOUT + FLOW_TIMEOUT + 60)

Fields = dict[str, str]


def job_command(out: Path, run: str, *extra: str) -> list[str]:
    return [
        PYTHON,
        str(JOB_SCRIPT),
        f"--spec={SPEC}",
        f"--cache={out / 'cache'}",
        f"--out={out}",
        f"--run={run}",
        "--workers=2",
        f"--epochs={EPOCHS}",
        *extra,
    ]


def batch_script(name: str, output: Path, command: list[str]) -> str:
    return (
        "#!/bin/bash\n"
        f"#SBATCH --job-name={name}\n"
        "#SBATCH --ntasks=1\n"
        f"#SBATCH --time={TIME_LIMIT}\n"
        f"#SBATCH --signal=B:USR1@{WARN}\n"
        "#SBATCH --requeue\n"
        "#SBATCH --open-mode=append\n"
        f"#SBATCH --output={output}\n"
        "# With B: SLURM signals this script's process only: exec makes it the trainer.\n"
        f"exec {shlex.join(command)}\n"
    )


def batches(path: Path) -> list[tuple[int, list[str]]]:
    """(epoch, keys) of every batch a run logged, in order."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [(r["epoch"], r["keys"]) for r in map(json.loads, lines)]


def scontrol(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["scontrol", *args], capture_output=True, text=True, timeout=30, check=False
    )


def timestamp(slurm_time: str) -> float:
    """A SLURM time (local, whole seconds: ``2026-11-23T20:25:56``) as a Unix time."""
    return datetime.fromisoformat(slurm_time).timestamp()


class Job:
    """A submitted batch job: polls its record (``scontrol show job``); fails with its
    record, output, slurmctld log lines and files."""

    def __init__(self, job_id: str, out: Path, output: Path) -> None:
        self.id, self.out, self.output = job_id, out, output
        self.timings: dict[str, float] = {}
        self.t0 = time.monotonic()

    def fields(self) -> Fields:
        proc = scontrol("--oneliner", "show", "job", self.id)
        return dict(f.split("=", 1) for f in proc.stdout.split() if "=" in f)

    def wait_for(self, what: str, deadline: float, done: Callable[[Fields], bool]) -> Fields:
        """Poll (until ``deadline``) for ``done(record)``; fail at once if the job ended
        otherwise."""
        while True:
            fields = self.fields()
            if done(fields):
                self.timings[what] = round(time.monotonic() - self.t0, 1)
                return fields
            if fields.get("JobState") in _FINAL_STATES:
                self.fail(f"ended ({fields['JobState']}) before {what}")
            if time.monotonic() > deadline:
                self.fail(f"timed out waiting for {what}")
            time.sleep(POLL)  # poll interval of a bounded wait, not a synchronisation

    def update(self, *settings: str) -> None:
        proc = scontrol("update", f"JobId={self.id}", *settings)
        if proc.returncode != 0:
            self.fail(f"scontrol update {' '.join(settings)}: {proc.stdout}{proc.stderr}")

    def diagnostics(self) -> str:
        record = scontrol("show", "job", self.id)
        output = self.output.read_text() if self.output.exists() else "(no output file)\n"
        config = scontrol("show", "config").stdout.split()
        log_file = "slurmctld.log"
        try:  # "SlurmctldLogFile = <path>"
            log_file = config[config.index("SlurmctldLogFile") + 2]
            lines = Path(log_file).read_text(errors="replace").splitlines()
            log = "\n".join(ln for ln in lines if f"JobId={self.id} " in f"{ln} ")
        except (OSError, ValueError, IndexError) as exc:
            log = f"({exc!r})"
        files = sorted(p.name for p in self.out.iterdir())
        return (
            f"\n--- timings (s since sbatch): {self.timings}"
            f"\n--- scontrol show job {self.id}:\n{record.stdout}{record.stderr}"
            f"--- job output ({self.output}):\n{output}"
            f"--- {log_file} lines of the job:\n{log}\n--- files in {self.out}: {files}"
        )

    def fail(self, message: str) -> None:
        pytest.fail(f"job {self.id}: {message}{self.diagnostics()}")


def test_time_limit_signal_checkpoint_requeue_resumes_exactly(
    slurm: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    s3: S3Server,
) -> None:
    shards = {f"train-{i:06d}.tar": tar_bytes(shard_samples(i, PER_SHARD)) for i in range(NSHARDS)}
    s3.put_objects(BUCKET, shards)
    env = task_env(s3)
    ref, out = tmp_path / "reference", tmp_path / "job"
    ref.mkdir()
    out.mkdir()
    output = out / "job.out"
    script = tmp_path / "job.sh"
    command = job_command(
        out,
        "slurm{restart}",
        "--checkpoint-on-signal",
        f"--wait-for-signal-at={WAIT_AT}",
        f"--resume={out / 'ckpt-signal'}",
    )
    script.write_text(batch_script(f"shardcache-test-{uuid.uuid4().hex[:12]}", output, command))

    submit = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert submit.returncode == 0, f"sbatch exited {submit.returncode}: {submit.stderr}"
    job = Job(submit.stdout.strip().split(";")[0], out, output)
    deadline = time.monotonic() + FLOW_TIMEOUT
    try:
        first = job.wait_for("start", deadline, lambda f: f.get("JobState") == "RUNNING")
        # Until the job waits for the signal it has the machine to itself (2 CPUs here).
        job.wait_for(
            "batch WAIT_AT or the signal",
            deadline,
            lambda _: (out / "waiting-slurm0").exists() or (out / "ckpt-signal").exists(),
        )
        reference = subprocess.run(
            job_command(ref, "ref"),
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
        )
        assert reference.returncode == 0, f"the reference run failed:\n{reference.stderr}"
        job.timings["reference done"] = round(time.monotonic() - job.t0, 1)
        requeued = job.wait_for(
            "the requeue",
            deadline,
            lambda f: f.get("JobState") == "PENDING" and f.get("Restarts") == "1",
        )
        # slurmd refuses a launch credential no newer than the revocation (whole seconds,
        # stamped at the requeue, before the PENDING just seen): wait for the clock to
        # pass that second, then make the job eligible now.
        time.sleep(max(0.0, math.floor(time.time()) + 1 - time.time()))
        job.update("StartTime=now", f"TimeLimit={SECOND_TIME_LIMIT}")
        final = job.wait_for("the end", deadline, lambda f: f.get("JobState") in _FINAL_STATES)
    finally:
        if "the end" not in job.timings:  # nothing outlives the test
            subprocess.run(["scancel", job.id], capture_output=True, timeout=30, check=False)

    details = job.diagnostics()
    print(details)  # shown by pytest on a failure below
    assert (final["JobState"], final["ExitCode"], final["Restarts"]) == ("COMPLETED", "0:0", "1")
    assert requeued["Reason"] == "BeginTime"  # what the StartTime update is for

    # SLURM's time-limit warning, not anything else, made the checkpoint: SIGUSR1 arrived
    # at the first limit check >= end - WARN - PERIODIC, and before the limit.
    signalled = json.loads((out / "signalled-slurm0-rank0.json").read_text())
    start = timestamp(first["StartTime"])
    earliest = start + 60 * TIME_LIMIT - WARN - PERIODIC
    assert earliest - 1 <= signalled["received_at"] <= start + 60 * TIME_LIMIT, signalled
    # The checkpoint follows batch WAIT_AT, where the job waited for the signal, or an
    # earlier batch if the signal came first (the job reaches WAIT_AT 3-7 s after its
    # start, the signal >= 10 s): mid-epoch either way.
    step = signalled["step"]
    assert 1 <= step <= WAIT_AT and signalled["waited"] == (step == WAIT_AT), signalled

    expected = batches(ref / "keys-ref-rank0.jsonl")
    every_key = sorted(f"s{s:04d}_{i:05d}" for s in range(NSHARDS) for i in range(PER_SHARD))
    for epoch in range(EPOCHS):  # the reference reads every sample once per epoch
        assert sorted(k for e, keys in expected if e == epoch for k in keys) == every_key
    first_run = batches(out / "keys-slurm0-rank0.jsonl")
    second_run = batches(out / "keys-slurm1-rank0.jsonl")
    assert first_run == expected[:step]  # and not a batch more: it stopped at the checkpoint
    assert second_run[0][0] == 0, "the second run did not resume in the first epoch"
    assert second_run == expected[step:]
    assert (out / "done-slurm1-rank0").read_text() == str(len(expected) - step)
    assert not list(out.glob("keys-slurm2-*")), "the job was requeued twice"
