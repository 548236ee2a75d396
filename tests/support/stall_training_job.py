"""A training loop over the WebDataset stage with DataLoader worker processes.

Run by tests/integration/prefetch/test_stall_conditions.py as its own process (``python
stall_training_job.py SPEC CACHE_DIR ENDPOINT STALL_TIMEOUT IO_TIMEOUT``) so the test can
bound the wait and read what a user would see: every sample key on stdout, and an uncaught
exception's traceback on stderr. The job does not catch anything: how it ends is the point
of the test.
"""

from __future__ import annotations

import sys

import webdataset as wds
from torch.utils.data import DataLoader

import shardcache
from shardcache import ShardCache


def main(spec: str, cache_dir: str, endpoint: str, stall_timeout: float, io_timeout: float) -> None:
    cache = ShardCache(
        cache_dir, storage_options={"endpoint_url": endpoint}, io_timeout=io_timeout, retries=0
    )
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(spec),
        shardcache.split_by_node,
        wds.split_by_worker,
        # A handler that skips failed shards, as long jobs often use: a stall is not a fault
        # of one shard, so it must still end the job.
        shardcache.tarfile_to_samples(
            wds.warn_and_continue,
            cache=cache,
            threads=2,
            depth=2,
            stall_timeout=stall_timeout,
        ),
        wds.to_tuple("__key__", "cls"),
    )
    loader = DataLoader(pipeline, batch_size=None, num_workers=2)
    for key, _cls in loader:
        print(f"sample {key}", flush=True)
    print("epoch finished", flush=True)


if __name__ == "__main__":
    spec, cache_dir, endpoint, stall, io = sys.argv[1:]
    main(spec, cache_dir, endpoint, float(stall), float(io))
