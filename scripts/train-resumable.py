#!/usr/bin/env python
"""Train on a shardcache.ResumableDataset, checkpointing where the data stands and resuming
from it: the training script of scripts/sbatch-resumable.sh (copy both and put your model
in ``train_step``).

    srun python scripts/train-resumable.py --shards 's3://bucket/train-{000000..001023}.tar' \\
        --index s3://bucket/train.index.json --ckpt ckpt/

Ranks come from SLURM (srun) or torchrun; with more than one, torch.distributed starts
from MASTER_ADDR / MASTER_PORT (the sbatch template exports them). Every
``--checkpoint-every`` steps, and after each epoch, every rank writes its
StatefulDataLoader state and rank 0 the job's state and the epoch into ``--ckpt``. A rerun
(a requeued or resubmitted job) resumes from there: exactly with the same ranks and
workers, elastically with others (each sample of the epoch still once).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

import shardcache
from shardcache.distributed import rank_info

log = logging.getLogger("train")


def train_step(batch: list[dict[str, Any]]) -> None:
    """Your model's forward, backward and optimizer step over ``batch`` (WebDataset samples:
    ``{"__key__": ..., "jpg": bytes, ...}``; decode them with ``dataset.decode(...)``)."""


def as_list(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return samples


def write_json(path: Path, data: Any) -> None:
    """``data`` into ``path`` atomically: a reader never sees half a checkpoint."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(json.dumps(data))
    os.replace(part, path)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", required=True, help="shard spec (brace pattern, @manifest)")
    p.add_argument("--index", help="sample index made by 'shardcache index' (else learned)")
    p.add_argument("--ckpt", type=Path, required=True, help="checkpoint directory (shared)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank")
    p.add_argument("--shuffle-buffer", type=int, default=1000)
    p.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS")
    p.add_argument("--max-steps", type=int, help="stop after a checkpoint at this many steps")
    p.add_argument("--log-keys", type=Path, help="append each batch's keys to DIR/keys-<rank>")
    return p.parse_args()


class Job:
    """One rank's training: its dataset and loader, checkpoints and the resume."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        ranks = rank_info()
        self.rank, self.world = ranks.rank, ranks.world_size
        self.dataset = shardcache.ResumableDataset(
            args.shards, seed=args.seed, index=args.index, shuffle_buffer=args.shuffle_buffer
        )
        self.dataset.prepare(workers=args.workers)  # index and split once, before the workers
        self.loader = StatefulDataLoader(
            self.dataset, batch_size=args.batch_size, num_workers=args.workers, collate_fn=as_list
        )
        self.keys = None
        if args.log_keys is not None:
            args.log_keys.mkdir(parents=True, exist_ok=True)
            self.keys = (args.log_keys / f"keys-{self.rank}").open("a")

    def resume(self) -> int:
        """Load the checkpoint, if any; the epoch to start from."""
        ckpt = self.args.ckpt
        if not (ckpt / "meta.json").exists():
            return 0
        meta = json.loads((ckpt / "meta.json").read_text())
        if (meta["world"], meta["workers"]) == (self.world, self.args.workers):  # exact
            state = json.loads((ckpt / f"loader-{self.rank}.json").read_text())
            self.loader.load_state_dict(state)
        else:  # elastic: another layout deals the epoch's rest out again
            self.dataset.load_state_dict(json.loads((ckpt / "job.json").read_text()))
        log.info("resumed epoch %d from %s", meta["epoch"], ckpt)
        return int(meta["epoch"])

    def checkpoint(self, epoch: int) -> None:
        """Every rank's loader state, and (rank 0) the job's state and the epoch."""
        ckpt, state = self.args.ckpt, self.loader.state_dict()
        write_json(ckpt / f"loader-{self.rank}.json", state)
        states = [state]
        if self.world > 1:
            states = [None] * self.world
            dist.all_gather_object(states, state)
        if self.rank == 0:
            write_json(ckpt / "job.json", shardcache.job_state(*states))
            meta = {"epoch": epoch, "world": self.world, "workers": self.args.workers}
            write_json(ckpt / "meta.json", meta)
        if self.world > 1:
            dist.barrier()  # no rank goes on (or stops) before the checkpoint is complete

    def train(self) -> None:
        args, steps = self.args, 0
        args.ckpt.mkdir(parents=True, exist_ok=True)
        for epoch in range(self.resume(), args.epochs):
            self.dataset.set_epoch(epoch)
            log.info("epoch %d: %d samples on this rank", epoch, len(self.dataset))
            for batch in self.loader:
                train_step(batch)
                if self.keys is not None:
                    self.keys.write("".join(f"{epoch} {s['__key__']}\n" for s in batch))
                    self.keys.flush()
                steps += 1
                if steps % args.checkpoint_every == 0 or steps == args.max_steps:
                    self.checkpoint(epoch)
                if steps == args.max_steps:
                    log.info("stopping after %d steps (--max-steps)", steps)
                    return
            self.checkpoint(epoch)  # the epoch's end: a rerun starts the next one
        log.info("done: %d epochs", args.epochs)


def main() -> None:
    args = parse_args()
    ranks = rank_info()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {ranks.rank}: %(message)s")
    if ranks.world_size > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world_size)
    try:
        Job(args).train()
    finally:
        if ranks.world_size > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
