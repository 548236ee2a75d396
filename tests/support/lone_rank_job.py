"""A torchrun job of 2 ranks in which only rank 0 uses a ``ResumableDataset`` without an
index, for tests/system/test_ddp_epochs.py (not a test module).

With a process group, learning the sample index is a collective: rank 0's ``prepare()``
must fail once the group's timeout (``--timeout`` seconds) has passed, with a
``SampleIndexError`` saying that every rank must call it. Rank 0 writes the error's type
and message to ``<out>/rank-0.json``. Rank 1 takes no part in it: it waits (bounded) for
that file, then leaves.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch.distributed as dist
from processes import exit_at_once

import shardcache
from shardcache.distributed import wait_for


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--timeout", type=float, default=5.0, help="collective timeout (s)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    result = args.out / "rank-0.json"
    if dist.get_rank() != 0:
        wait_for(result.exists, "rank 0's result", timeout=120, path=result)
        return 0
    dataset = shardcache.ResumableDataset(args.spec, cache=shardcache.ShardCache(args.cache))
    try:
        dataset.prepare()
        outcome = {"error": None}
    except Exception as exc:  # the test checks which
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps(outcome))
    tmp.replace(result)
    return 0


if __name__ == "__main__":
    exit_at_once(main())
