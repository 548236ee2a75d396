#!/bin/bash
# Warm every node's local shard cache, then train reading through it: an sbatch template.
#
#   sbatch --export=ALL,SHARDS='s3://bucket/train-{000000..001023}.tar' scripts/sbatch-example.sh
#
# Copy it and adapt the #SBATCH lines, SHARDCACHE_DIR and TRAIN_CMD to your site. The job
# has two steps with the SAME task layout (nodes x ntasks-per-node):
#
#   1. `shardcache warm --split auto` with node scope: on each node, local rank 0 downloads
#      exactly the shards that node's ranks will read in step 2 (the union of
#      shards[rank::world_size] over the node's ranks, which is what
#      shardcache.split_by_node gives each rank), in parallel, into the node's cache;
#      the node's other tasks have nothing to do and exit at once.
#   2. the training command on every task; its reads are cache hits.
#
# Why the warm step does not use `srun --ntasks-per-node=1`: with one task per node,
# world_size would be the number of nodes and each node would warm
# shards[node::nodes], which is NOT the set its 8 ranks read in step 2
# (shards[rank::nodes*8] for ranks node*8 .. node*8+7), so most training reads would
# miss. Running warm with the training layout makes the split identical by construction,
# at the cost of starting 7 short-lived processes per node.
#
# Environment (pass with `sbatch --export=ALL,NAME=value ...` or export before sbatch):
#   SHARDS            required: shard spec (brace pattern, "@manifest.txt", ...).
#   SHARDCACHE_DIR    cache root on node-local disk (default below); the same path on
#                     every node.
#   TRAIN_CMD         training command run by every task (default "python train.py"); it
#                     is split on whitespace, so use a script for anything with quoting.
#   AWS_*             S3 endpoint / credentials, as for any boto3 / s3fs program.
#   WARM_THREADS      parallel downloads of the warming task on each node (default 16),
#                     given to the warm step alone (--threads): exported as
#                     SHARDCACHE_THREADS it would also give every DataLoader worker of every
#                     training rank that many prefetch threads.
#
# train.py reads the data through the cache, e.g.
#     pipeline = wds.DataPipeline(wds.SimpleShardList(os.environ["SHARDS"]),
#                                 shardcache.split_by_node, wds.split_by_worker,
#                                 shardcache.tarfile_to_samples(), ...)
# shardcache takes rank / world size from SLURM_PROCID / SLURM_NTASKS (see the launcher
# table in docs/reference/configuration.md) and SHARDCACHE_DIR / SHARDCACHE_SCOPE from this script. For
# torch.distributed, init_process_group(init_method="env://", rank=int(SLURM_PROCID),
# world_size=int(SLURM_NTASKS)) with the MASTER_ADDR / MASTER_PORT exported below.
#
#SBATCH --job-name=shardcache-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

: "${SLURM_JOB_ID:?submit this script with sbatch (it runs srun steps inside the allocation)}"
: "${SHARDS:?set SHARDS to the shard spec, e.g. sbatch --export=ALL,SHARDS='s3://bucket/train-{000000..001023}.tar' $0}"

# Node-local storage, computed ONCE here and exported, so that every task of both steps
# on every node uses the same directory. (Do not leave it to each task's $TMPDIR: some
# sites give each job step, or each task, its own TMPDIR, and then step 2 would look for
# the shards step 1 warmed in another directory.)
# - $SLURM_TMPDIR (set by some sites) is a per-job directory on local disk, emptied when
#   the job ends: each job warms afresh.
# - /tmp otherwise: on most compute nodes a local disk, kept across jobs, so a rerun on
#   the same nodes is all cache hits. If /tmp is a small RAM disk on your nodes, point
#   SHARDCACHE_DIR at the local NVMe (often /local, /scratch/local or /lscratch).
# Never a shared file system (home, project, Lustre/GPFS): that defeats the cache.
SHARDCACHE_DIR="${SHARDCACHE_DIR:-${SLURM_TMPDIR:-/tmp}/shardcache-${USER:-$(id -un)}}"
# One cache per node, shared by its ranks: each shard is downloaded once per node.
SHARDCACHE_SCOPE=node
export SHARDCACHE_DIR SHARDCACHE_SCOPE

# Rendezvous for torch.distributed (env://): the first node of the allocation.
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${MASTER_PORT:-29500}"
export MASTER_ADDR MASTER_PORT

echo "job $SLURM_JOB_ID: ${SLURM_JOB_NUM_NODES} node(s), ${SLURM_NTASKS} tasks; cache $SHARDCACHE_DIR (scope node)"

# Step 1: warm each node's cache (local rank 0 per node downloads; see the header).
# A shard that cannot be fetched fails the step (exit 1, the failures listed) and so the
# job: append `|| true` to train anyway and let training fetch (or skip) what is missing.
srun --kill-on-bad-exit=1 shardcache warm "$SHARDS" --split auto --threads "${WARM_THREADS:-16}"

# Step 2: train. Every task reads its shards through the node's cache.
# shellcheck disable=SC2086  # TRAIN_CMD is a command line, split on purpose
srun --kill-on-bad-exit=1 ${TRAIN_CMD:-python train.py}
