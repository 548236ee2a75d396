"""A DDP training job for tests/system/test_ddp_epochs.py and
tests/system/test_slurm_epochs.py, run under torchrun or as ``srun`` tasks (not a test
module).

It reads a ``shardcache.ResumableDataset`` through torchdata's StatefulDataLoader and
steps a tiny ``DistributedDataParallel`` model once per batch: the gradient all-reduce in
``backward()`` is the collective that hangs (until the process group's timeout) if the
ranks yield different numbers of batches in an epoch. The timeout is ``--timeout``
seconds (default: the suite's ``COLLECTIVE_TIMEOUT``), so such a job fails instead of
hanging.

Per rank, one JSON line per epoch goes to ``<out>/rank-<r>.jsonl``: the epoch, the number
of batches, every sample key delivered (in order) and, from ``loader.state_dict()`` taken
after the epoch, each DataLoader worker's consumer slot, delivered count and ``sizes``.

Under torchrun the process group comes from torchrun's variables. As an ``srun`` task
(no ``RANK`` set) the rank and world size are ``SLURM_PROCID`` and ``SLURM_NTASKS``, and
``MASTER_ADDR`` / ``MASTER_PORT`` must be set by whoever launches the job (an address every
node reaches; ``GLOO_SOCKET_IFNAME`` too when the hostname does not resolve). The dataset
takes its ranks, local world size and cache scope from the same variables
(``SHARDCACHE_SCOPE=node``: one cache per node).

``--index FILE`` gives the dataset a sample index made ahead (``shardcache index``); without
it the dataset learns the sample offsets (at the first ``set_epoch``, each rank its own
cache's shards, gathered through the process group) and keeps them (``--keep-index``:
``cache`` or ``data``). ``--log-info`` shows shardcache's INFO lines on stderr.

``--runs JSON``: several runs in one job (one launch, one process group and model), one
after the other: a list of objects, each with a ``name`` and any of ``spec``, ``epochs``,
``batch_size``, ``remainder``, ``epoch_size``; run ``name`` reads through its own cache
``<cache>/<name>`` and logs to ``<out>/<name>/``.

``--lock FILE`` gives the dataset a lockfile (with ``SHARDCACHE_MESH=1``, what makes its
misses ask the other nodes). ``--shuffle-scope global`` deals the shards across the job anew
every epoch, so later epochs read shards another node's cache filled in epoch 0.
``--mesh-addrs A,B,...``: node *k* serves on the *k*-th address (``SHARDCACHE_MESH_ADDR``, for a job
meeting in a shared directory). With the mesh on, the job writes the counts of this node's
mesh server (local rank 0's; after the last barrier, once it is idle) to
``<out>/mesh-<rank>.json``.

``--mark-epochs URL`` (a bucket URL on the S3 server): after each epoch, once every rank has
passed the epoch's barrier, rank 0 sends ``HEAD <URL>/epoch-<e>``; the server's request log
then shows where each epoch's requests end (every request of the epoch was answered before
the barrier, so it is logged before the mark).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from processes import COLLECTIVE_TIMEOUT, end_process_group, exit_at_once
from torchdata.stateful_dataloader import StatefulDataLoader
from worker_stacks import stacks_on_sigusr2, watched

import shardcache


def key_and_features(stream: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Only what the job uses crosses the worker pipes: the key and 4 input features."""
    for sample in stream:
        data = sample["bin"]
        features = [data[i % len(data)] / 255.0 for i in range(4)]
        yield {"__key__": sample["__key__"], "x": features}


def collate(batch: list[dict[str, Any]]) -> tuple[list[str], torch.Tensor]:
    keys = [sample["__key__"] for sample in batch]
    return keys, torch.tensor([sample["x"] for sample in batch], dtype=torch.float32)


def consumer_states(loader: StatefulDataLoader) -> list[dict[str, Any]]:
    """Each worker's dataset state in the loader's state: slot, delivered, sizes."""
    parts = shardcache.job_state(loader.state_dict())["parts"]
    return [
        {"slot": p.get("slot"), "delivered": p.get("delivered"), "sizes": p.get("sizes")}
        for p in parts
    ]


def mark(url: str, epoch: int) -> None:
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        conn.request("HEAD", f"{where.path.rstrip('/')}/epoch-{epoch}")
        conn.getresponse().read()  # any status: only its place in the log counts
    finally:
        conn.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--cache", required=True, help="the cache directory (SHARDCACHE_DIR)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--first-epoch", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--remainder", default="pad")
    parser.add_argument("--epoch-size", type=int, default=None)
    parser.add_argument("--shuffle-buffer", type=int, default=10)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument(
        "--timeout", type=float, default=COLLECTIVE_TIMEOUT, help="collective timeout (s)"
    )
    parser.add_argument("--mark-epochs", default=None, metavar="URL")
    parser.add_argument("--index", default=None, metavar="FILE", help="a sample index file")
    parser.add_argument("--keep-index", default="cache", choices=("cache", "data"))
    parser.add_argument("--lock", default=None, metavar="FILE", help="a dataset lockfile")
    parser.add_argument("--shuffle-scope", default="cache", help="the dataset's shuffle_scope")
    parser.add_argument("--mesh-addrs", default=None, help="each node's address, by node id")
    parser.add_argument("--log-info", action="store_true", help="shardcache's INFO on stderr")
    parser.add_argument("--runs", type=json.loads, default=None, help="several runs (JSON)")
    return parser.parse_args()


def init_process_group(timeout: float) -> None:
    """gloo, with torchrun's variables or, in an ``srun`` task, SLURM's."""
    limit = datetime.timedelta(seconds=timeout)
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=limit)
    else:
        dist.init_process_group("gloo", timeout=limit)


def train(
    args: argparse.Namespace,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Train ``args.epochs`` epochs of ``args.spec``, a JSON line per epoch."""
    dataset = shardcache.ResumableDataset(
        args.spec,
        seed=args.seed,
        shuffle_buffer=args.shuffle_buffer,
        remainder=args.remainder,
        epoch_size=args.epoch_size,
        index=args.index,
        keep_index=args.keep_index,
        cache=shardcache.ShardCache(args.cache),
        lock=args.lock,
        shuffle_scope=args.shuffle_scope,
    ).compose(key_and_features)
    loader = StatefulDataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=collate,
        # A stuck worker fails its rank, with its stacks (watched), before the other
        # ranks' collective times out without saying why.
        timeout=COLLECTIVE_TIMEOUT / 2,
        worker_init_fn=stacks_on_sigusr2,
    )
    stacks_on_sigusr2()  # inherited by the forked workers, even one stuck before its init
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"rank-{rank}.jsonl").open("a") as log:
        for epoch in range(args.first_epoch, args.epochs):
            dataset.set_epoch(epoch)
            batches, keys = 0, []
            for batch_keys, x in watched(loader):
                optimizer.zero_grad()
                loss = model(x).square().mean()
                loss.backward()  # the all-reduce: every rank must take part, every batch
                optimizer.step()
                batches += 1
                keys += batch_keys
            record = {
                "epoch": epoch,
                "batches": batches,
                "keys": keys,
                "consumers": consumer_states(loader),
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            dist.barrier()
            if args.mark_epochs is not None and rank == 0:
                mark(args.mark_epochs, epoch)
            dist.barrier()  # no rank starts the next epoch before the mark


def write_mesh_counts(out: Path, rank: int) -> None:
    """This node's mesh server's counts, once no request is being answered (every rank is
    past its last epoch's barrier: no peer asks any more)."""
    if os.environ.get("SHARDCACHE_MESH") != "1":
        return
    node = shardcache.ShardCache.from_env().mesh  # the process's place in the mesh (once)
    if node is None:
        raise RuntimeError("SHARDCACHE_MESH=1, but this process is not in the mesh (see the log)")
    server = node.server
    counts = None
    if server is not None:
        if not server.wait_idle(COLLECTIVE_TIMEOUT):
            raise RuntimeError(
                f"the mesh server {server.address} is still answering after {COLLECTIVE_TIMEOUT} s"
            )
        counts = server.counts()
    record = {"node": node.membership.own_node, "peers": len(node.membership.peers())}
    (out / f"mesh-{rank}.json").write_text(json.dumps({**record, "server": counts}))


def runs_of(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The job's runs: the one its options give or, with ``--runs``, each run's options over
    them, with the run's own cache and log directory."""
    if args.runs is None:
        return [args]
    return [
        argparse.Namespace(
            **{
                **vars(args),
                **run,
                "out": args.out / run["name"],
                "cache": str(Path(args.cache) / run["name"]),
            }
        )
        for run in args.runs
    ]


def main() -> int:
    args = parse_args()
    if args.mesh_addrs is not None:  # this node's mesh address (a shared directory meets)
        addrs = args.mesh_addrs.split(",")
        os.environ["SHARDCACHE_MESH_ADDR"] = addrs[int(os.environ["SLURM_NODEID"])]
    if args.log_info:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("shardcache").setLevel(logging.INFO)
    init_process_group(args.timeout)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    for run in runs_of(args):
        train(run, rank, model, optimizer)
    write_mesh_counts(args.out, rank)
    del model, optimizer  # the DDP model holds the process group
    end_process_group()
    return 0


if __name__ == "__main__":
    exit_at_once(main())
