#!/bin/bash
# Train on a shardcache.ResumableDataset under SLURM: activate your environment, warm each
# node's cache with exactly the shards its ranks will read, train, and resume from the last
# checkpoint when the job is requeued or resubmitted. An sbatch template:
#
#   sbatch --export=ALL,VENV=$HOME/venvs/train,SHARDS='s3://bucket/train-{000000..001023}.tar',INDEX=s3://bucket/train.index.json scripts/sbatch-resumable.sh
#
# Copy it with scripts/train-resumable.py (put your model in its train_step) and adapt the
# #SBATCH lines. Make the index once, before the first job:
#   shardcache index 's3://bucket/train-{000000..001023}.tar' -o train.index.json
#
# Environment (sbatch --export=ALL,NAME=value ... or exported before sbatch):
#   SHARDS          required: the shard spec (brace pattern, "@manifest.txt", ...).
#   INDEX           required: the sample index (path or URL) made by 'shardcache index'.
#   VENV            a virtual environment to activate (its bin/activate), or
#   CONDA_ENV       a conda environment to activate (needs conda on PATH); with neither,
#                   the environment sbatch was called from (--export=ALL keeps its PATH).
#   CKPT            checkpoint directory on a shared file system (default: ./ckpt-<job name>);
#                   a rerun resumes from it.
#   SEED, EPOCHS, WORKERS, BATCH_SIZE   the training's (defaults 0, 2, 4, 32); the warm step
#                   gets the same SEED, so it warms what the dataset will read.
#   SHARDCACHE_DIR  cache root on node-local disk (default below), the same on every node.
#   WARM_THREADS    parallel downloads of each node's warming task (default 16).
#   TRAIN_SCRIPT    the training script (default scripts/train-resumable.py).
#   AWS_*           S3 endpoint and credentials, as for any boto3 / s3fs program.
#
#SBATCH --job-name=shardcache-resumable
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --output=%x-%j.out

set -euo pipefail

: "${SLURM_JOB_ID:?submit this script with sbatch (it runs srun steps inside the allocation)}"
: "${SHARDS:?set SHARDS to the shard spec, e.g. sbatch --export=ALL,SHARDS='s3://bucket/train-{000000..001023}.tar',INDEX=... $0}"
: "${INDEX:?set INDEX to the sample index made by: shardcache index \"\$SHARDS\" -o train.index.json}"

# The environment: activated here, inherited by every srun task below.
if [[ -n "${VENV:-}" ]]; then
    # shellcheck disable=SC1091  # the user's environment
    source "$VENV/bin/activate"
elif [[ -n "${CONDA_ENV:-}" ]]; then
    eval "$(conda shell.bash hook)"
    conda activate "$CONDA_ENV"
fi
if ! command -v shardcache >/dev/null; then
    echo "shardcache is not installed in this environment ($(command -v python || echo 'no python')):" \
        "set VENV=/path/to/venv or CONDA_ENV=name, or install shardcache into it" >&2
    exit 1
fi

# One cache per node on node-local disk, shared by the node's ranks (see sbatch-example.sh
# for why it is computed once here: both steps must use the same directory).
SHARDCACHE_DIR="${SHARDCACHE_DIR:-${SLURM_TMPDIR:-/tmp}/shardcache-${USER:-$(id -un)}}"
SHARDCACHE_SCOPE=node
export SHARDCACHE_DIR SHARDCACHE_SCOPE

# torch.distributed rendezvous (env://): the first node of the allocation.
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${MASTER_PORT:-29500}"
export MASTER_ADDR MASTER_PORT

SEED="${SEED:-0}"
CKPT="${CKPT:-$PWD/ckpt-${SLURM_JOB_NAME:-shardcache-resumable}}"
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): ${SLURM_NTASKS} tasks; python $(command -v python); cache $SHARDCACHE_DIR; checkpoints $CKPT"

# Step 1: warm what the dataset reads through each node's cache in every epoch (local rank 0
# of each node downloads; the split is by samples, hence the index and the same seed).
# Drop this step to let training fetch as it goes; on a rerun it is all hits.
srun --kill-on-bad-exit=1 shardcache warm "$SHARDS" --split dataset --index "$INDEX" \
    --seed "$SEED" --threads "${WARM_THREADS:-16}"

# Step 2: train, resuming from $CKPT when it holds a checkpoint.
srun --kill-on-bad-exit=1 python "${TRAIN_SCRIPT:-scripts/train-resumable.py}" \
    --shards "$SHARDS" --index "$INDEX" --seed "$SEED" --ckpt "$CKPT" \
    --epochs "${EPOCHS:-2}" --workers "${WORKERS:-4}" --batch-size "${BATCH_SIZE:-32}"
