"""A job with no torch.distributed process group, for tests/system/test_index_exchange_jobs.py
(not a test module): under torchrun or as ``srun`` tasks, each rank iterates a
``shardcache.ResumableDataset`` (no index given) through a DataLoader with ``--workers``
workers, so that the dataset first meets its shards in the workers, every epoch anew (they
are not persistent). The ranks learn the sample index through the job's store (torchrun's
agent store, or the one SLURM task 0 serves), which the job itself never touches.

Per rank, one JSON line per epoch goes to ``<out>/rank-<r>.jsonl``: the epoch and every
sample key delivered. ``--mark-epochs URL``: after each epoch, once every rank has written
``<out>/done-<epoch>-<rank>`` (the ranks share ``--out``: one node), rank 0 sends ``HEAD
<URL>/epoch-<e>`` and writes ``<out>/marked-<epoch>``, which the other ranks await before
the next epoch; every wait is bounded (``--timeout``). The arguments are those of
tests/support/ddp_epoch_job.py (only ``--spec``, ``--cache``, ``--out``, ``--epochs``,
``--workers``, ``--timeout`` and ``--mark-epochs`` are used). shardcache's INFO lines go
to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import torch.utils.data
from ddp_epoch_job import mark, parse_args
from processes import exit_at_once

import shardcache
from shardcache.distributed import rank_info, wait_for


def keys(batch: list[dict[str, Any]]) -> list[str]:
    return [sample["__key__"] for sample in batch]


def between_epochs(args: argparse.Namespace, epoch: int, rank: int, world_size: int) -> None:
    """Every rank has finished ``epoch``; rank 0 marks it in the server's log."""
    (args.out / f"done-{epoch}-{rank}").touch()
    if rank == 0:
        done = [args.out / f"done-{epoch}-{other}" for other in range(world_size)]
        wait_for(lambda: all(p.exists() for p in done), "every rank's epoch end", args.timeout)
        if args.mark_epochs is not None:
            mark(args.mark_epochs, epoch)
        (args.out / f"marked-{epoch}").touch()
    marked = args.out / f"marked-{epoch}"
    wait_for(marked.exists, f"rank 0's mark of epoch {epoch}", args.timeout)


def main() -> int:
    args = parse_args()
    logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("shardcache").setLevel(logging.INFO)
    ranks = rank_info()
    dataset = shardcache.ResumableDataset(args.spec, cache=shardcache.ShardCache(args.cache))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=8, num_workers=args.workers, collate_fn=keys, timeout=args.timeout
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"rank-{ranks.rank}.jsonl").open("a") as log:
        for epoch in range(args.epochs):
            dataset.set_epoch(epoch)  # no process group: nothing learned here
            delivered = [key for batch in loader for key in batch]
            log.write(json.dumps({"epoch": epoch, "keys": delivered}) + "\n")
            log.flush()
            between_epochs(args, epoch, ranks.rank, ranks.world_size)
    return 0


if __name__ == "__main__":
    exit_at_once(main())
