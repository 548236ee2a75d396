"""scripts/sbatch-resumable.sh submitted to the one-node SLURM cluster (``scripts/slurm-local``,
as test_slurm's tests): with only the system's PATH, it activates the virtual environment
named by ``VENV``, warms what the dataset reads (``warm --split dataset``), and trains with
scripts/train-resumable.py to the end; the training reads every shard from the cache
(each downloaded once, by the warm step) and leaves its last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ports import reserved_port
from repo import ROOT
from tars import shard_samples, tar_bytes
from test_slurm import (
    SETUP_TIMEOUT,
    VENV_BIN,
    sbatch_and_wait,
    slurm,  # noqa: F401 (the module fixture: skipped or failed as test_slurm's tests)
    task_env,
)

from shardcache.testing import S3Server

pytestmark = pytest.mark.timeout(SETUP_TIMEOUT + 240)
BUCKET = "slurm-resumable"
COUNTS = (12, 9, 11, 5, 8, 7)
SPEC = f"s3://{BUCKET}/train-{{0..{len(COUNTS) - 1}}}.tar"


def test_sbatch_resumable_activates_the_venv_warms_and_trains(
    slurm: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    s3: S3Server,
) -> None:
    shards = {f"train-{i}.tar": tar_bytes(shard_samples(i, n)) for i, n in enumerate(COUNTS)}
    s3.put_objects(BUCKET, shards)
    index = tmp_path / "train.index.json"
    env = task_env(s3)
    made = subprocess.run(
        [sys.executable, "-m", "shardcache", "index", SPEC, "-o", str(index)],
        env={**env, "SHARDCACHE_DIR": str(tmp_path / "index-cache")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    s3.clear_requests()

    script = tmp_path / "job.sh"
    lines = (ROOT / "scripts" / "sbatch-resumable.sh").read_text().splitlines(keepends=True)
    script.write_text("".join(ln for ln in lines if not ln.startswith("#SBATCH --gpus")))
    env |= {
        "PATH": "/usr/bin:/bin",  # shardcache and python come from the activated venv alone
        "VENV": str(VENV_BIN.parent),
        "SHARDS": SPEC,
        "INDEX": str(index),
        "SLURM_TMPDIR": str(tmp_path),
        "CKPT": str(tmp_path / "ckpt"),
        "TRAIN_SCRIPT": str(ROOT / "scripts" / "train-resumable.py"),
        "SEED": "5",
        "EPOCHS": "2",
        "WORKERS": "1",
        "BATCH_SIZE": "4",
    }
    out = tmp_path / "job.out"
    args = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=2"]
    with reserved_port() as port:  # rank 0's store binds it (the one node is this host)
        env["MASTER_PORT"] = str(port)
        state, exit_code = sbatch_and_wait([*args, f"--output={out}", str(script)], env, tmp_path)
    log = out.read_text() if out.exists() else "(no output file)"
    assert (state, exit_code) == ("COMPLETED", "0:0"), log
    assert f"python {VENV_BIN}/python" in log  # the venv was activated
    assert "warm: 6 of 6 shards ok" in log
    assert log.count("done: 2 epochs") == 2  # both ranks trained to the end
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta == {"epoch": 1, "world": 2, "workers": 1}
    gets = {key: s3.count("GET", BUCKET, key) for key in shards}
    assert gets == dict.fromkeys(shards, 1), log  # warmed once; training read only hits
