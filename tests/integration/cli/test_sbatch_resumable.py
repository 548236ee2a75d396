"""scripts/sbatch-resumable.sh and its training script, scripts/train-resumable.py: the
template activates the environment before its steps and warms what the dataset reads; the
training script, run for real under torchrun, stopped mid-epoch and rerun with another
worker count, delivers every sample of every epoch exactly once."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest
from processes import job_env, torchrun
from repo import ROOT
from slurm_stand_ins import slurm_stand_ins
from tars import shard_samples, tar_bytes

pytestmark = pytest.mark.timeout(240)
TEMPLATE = ROOT / "scripts" / "sbatch-resumable.sh"
TRAIN = ROOT / "scripts" / "train-resumable.py"
COUNTS = (12, 9, 11, 5, 8, 7)  # 52 samples: 2 ranks x 2 workers get 13 each, none repeated


def _stand_ins(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """SLURM's stand-ins (:mod:`slurm_stand_ins`), a virtual environment whose activate
    script puts its bin first on PATH, and the template's environment."""
    bin_dir, steps = slurm_stand_ins(tmp_path)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "shardcache").write_text("#!/bin/bash\n")
    (venv / "bin" / "shardcache").chmod(0o755)
    (venv / "bin" / "activate").write_text(
        f'export VIRTUAL_ENV="{venv}"\nexport PATH="{venv}/bin:$PATH"\n'
    )
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STEPS": str(steps),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NTASKS": "8",
        "SLURM_TMPDIR": str(tmp_path),
        "SHARDS": "s3://b/train-{0..9}.tar",
        "INDEX": "s3://b/train.index.json",
        "HOME": str(tmp_path),
    }
    return steps, venv, env


def _template(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(TEMPLATE)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_template_activates_the_environment_then_warms_and_trains(tmp_path: Path) -> None:
    steps, venv, env = _stand_ins(tmp_path)
    env |= {"VENV": str(venv), "SEED": "7"}
    ran = _template(tmp_path, env)
    assert ran.returncode == 0, ran.stderr
    warm, train = ((steps / f"{n}.args").read_text().splitlines() for n in (0, 1))
    assert warm == [
        "--kill-on-bad-exit=1",
        *("shardcache", "warm", env["SHARDS"], "--split", "dataset", "--index", env["INDEX"]),
        *("--seed", "7", "--threads", "16"),
    ]
    assert train[1:3] == ["python", "scripts/train-resumable.py"]
    assert train[3:11] == [
        *("--shards", env["SHARDS"], "--index", env["INDEX"], "--seed", "7"),
        *("--ckpt", f"{tmp_path}/ckpt-train"),
    ]
    for n in (0, 1):  # every step runs in the activated environment
        step_env = dict(
            line.split("=", 1)
            for line in (steps / f"{n}.env").read_text().splitlines()
            if "=" in line
        )
        assert step_env["VIRTUAL_ENV"] == str(venv)
        assert step_env["PATH"].startswith(f"{venv}/bin:")
        assert step_env["SHARDCACHE_SCOPE"] == "node"
        assert step_env["MASTER_ADDR"] == "node1"


def test_template_without_shardcache_in_the_environment_says_what_to_set(tmp_path: Path) -> None:
    steps, _venv, env = _stand_ins(tmp_path)
    ran = _template(tmp_path, env)
    assert ran.returncode == 1
    assert "set VENV=/path/to/venv or CONDA_ENV=name" in ran.stderr
    assert not list(steps.iterdir())  # no step started


def _train(tmp_path: Path, urls: list[str], *args: str) -> None:
    command = torchrun(
        2,
        TRAIN,
        *("--shards", "::".join(urls), "--ckpt", str(tmp_path / "ckpt"), "--seed", "3"),
        *("--epochs", "2", "--batch-size", "4", "--shuffle-buffer", "5", "--checkpoint-every", "2"),
        *("--log-keys", str(tmp_path / "keys"), *args),
    )
    env = job_env(SHARDCACHE_DIR=str(tmp_path / "cache"))
    ran = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert ran.returncode == 0, ran.stderr[-4000:]


def test_training_script_resumes_mid_epoch_exactly_and_elastically(tmp_path: Path) -> None:
    urls, every = [], Counter()
    for shard, count in enumerate(COUNTS):
        path = tmp_path / "data" / f"train-{shard}.tar"
        path.parent.mkdir(exist_ok=True)
        samples = shard_samples(shard, count, size=64)
        path.write_bytes(tar_bytes(samples))
        urls.append(str(path))
        every.update(key for key, _ in samples)
    _train(tmp_path, urls, "--workers", "2", "--max-steps", "3")  # stops mid-epoch 0
    logged = [(tmp_path / "keys" / f"keys-{r}").read_text().splitlines() for r in (0, 1)]
    assert [len(lines) for lines in logged] == [12, 12]  # 3 batches of 4 on each rank
    _train(tmp_path, urls, "--workers", "2", "--max-steps", "6")  # exact: the same layout
    _train(tmp_path, urls, "--workers", "1")  # elastic: another worker count, to the end
    by_epoch: dict[str, Counter[str]] = {"0": Counter(), "1": Counter()}
    for rank in (0, 1):
        for line in (tmp_path / "keys" / f"keys-{rank}").read_text().splitlines():
            epoch, key = line.split()
            by_epoch[epoch][key] += 1
    assert by_epoch == {"0": every, "1": every}  # each sample once an epoch, none lost
