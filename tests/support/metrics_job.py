"""A training job for the observability tests, run under ``torchrun``: every rank reads its
``split_by_node`` share of the shards through the WebDataset stage in DataLoader worker
processes, for a few epochs, with a fixed compute time per sample standing in for the
model, and ends each epoch with ``shardcache.log_epoch_summary`` (a collective on the gloo
group: rank 0 also logs the job's line). Logs go to stderr at INFO.

    torchrun --standalone --nproc_per_node=2 metrics_job.py --spec SPEC --cache DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch.distributed as dist
import webdataset as wds
from torch.utils.data import DataLoader

import shardcache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compute", type=float, default=0.01, help="seconds per sample")
    parser.add_argument("--out", required=True, help="directory for each rank's report lines")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    dist.init_process_group("gloo")
    cache = shardcache.ShardCache(args.cache)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(args.spec),
        shardcache.split_by_node,
        wds.split_by_worker,
        shardcache.tarfile_to_samples(cache=cache),
        wds.to_tuple("__key__", "cls"),
    )
    loader = DataLoader(pipeline, batch_size=None, num_workers=args.workers)
    for epoch in range(args.epochs):
        samples = 0
        for _key, _cls in loader:
            samples += 1
            time.sleep(args.compute)  # the model's step, not a synchronisation
        report = shardcache.log_epoch_summary(epoch)
        line = {"rank": dist.get_rank(), "epoch": epoch, "samples": samples, "report": report}
        # A file per rank: two ranks printing long lines to one pipe can interleave them.
        with open(f"{args.out}/report-rank{dist.get_rank()}.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
