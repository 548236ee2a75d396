"""A training job for the resume tests, run by torchrun and by sbatch (not a test module).

It reads a ResumableDataset through torchdata's StatefulDataLoader, logs every batch's
sample keys (``keys-<run>-rank<r>.jsonl``, one flushed line per batch) and saves
checkpoints the way docs/guides/resume.md shows:

- each rank's ``loader.state_dict()`` (``loader-rank<r>.json``): the exact resume, with
  the same world size and DataLoader workers;
- ``shardcache.job_state`` of every rank's state, gathered over torch.distributed
  (``job.json``): the elastic resume, with another world size or worker count.

``--checkpoint-at STEP ...`` saves ``<out>/ckpt-<STEP>/`` (``--ckpt-prefix`` replaces
``ckpt-``) after that many batches (of this run, counted over epochs). ``--then-wait`` makes
the last one a kill point: every rank writes ``killable-<run>-rank<r>`` and waits (bounded)
to be SIGKILLed. ``--check-delivery`` checks what the job delivered against the plan
(``dataset.check_delivery``, rank 0, over every rank's state) at each checkpoint and after
each epoch's last batch, and appends each check to ``delivery-<run>.jsonl``; a mismatch
fails the job with DeliveryMismatchError. ``--checkpoint-on-signal``
saves ``<out>/ckpt-signal`` after the batch during which SIGUSR1 arrived (SLURM's
``--signal``), writes ``signalled-<run>-rank<r>.json`` (when the signal arrived, the step it
checkpointed after, whether it had been waiting for it), then requeues the job
(``scontrol requeue``) and exits.
``--mixture-epoch-size N`` reads ``--spec`` as a ``MixtureDataset`` of ``NAME=WEIGHT=SPEC``
sources (comma-separated), each batch's keys logged as ``<source>/<key>``; ``--schedule JSON``
gives it a schedule: a list, one entry an epoch, each the sources' weights by name or a list
of ``[at, weights]`` steps.
``--model`` steps a tiny model once per batch, ``DistributedDataParallel`` over the gloo
group (``--timeout`` bounds every collective): ranks yielding different numbers of batches
fail the job instead of finishing; a DataLoader worker stuck for half of it fails its rank,
and a rank that torchrun stops prints its threads' stacks. ``--report`` ends each epoch with
``shardcache.log_epoch_summary`` (a collective) and rank 0 writes the job's report as
``report-<run>-epoch<e>.json``.
``--resume DIR`` starts from a checkpoint if DIR holds one; ``--lock FILE`` reads the
dataset under that lockfile. ``--run`` names the log; its
``{restart}`` is replaced by ``SLURM_RESTART_COUNT`` (0 outside SLURM).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from processes import COLLECTIVE_TIMEOUT, end_process_group, exit_at_once
from torchdata.stateful_dataloader import StatefulDataLoader
from worker_stacks import stacks_on_sigusr2, watched

import shardcache

KILL_WAIT = 300.0  # a kill point waits this long for the SIGKILL, then fails


def keys_of(batch: list[dict[str, Any]]) -> list[str]:
    """Each sample's key; a mixture's as ``<source>/<key>``."""
    return [key_of(sample) for sample in batch]


def key_of(sample: dict[str, Any]) -> str:
    key = sample["__key__"]
    return f"{sample['__source__']}/{key}" if "__source__" in sample else key


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def gathered(state: Any, world_size: int) -> list[Any]:
    """Every rank's ``state``."""
    states: list[Any] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(states, state)
    else:
        states = [state]
    return states


def check_delivery(dataset: Any, states: list[Any], log: Path, **facts: Any) -> None:
    """Rank 0: the job's delivery against the plan (raises on a mismatch), logged."""
    epoch_end = facts["at"] == "end of epoch"
    found = dataset.check_delivery(states, epoch_end=epoch_end)
    checks = found if isinstance(found, dict) else {"": found}
    record = {**facts, "checks": {name: c.as_json() for name, c in checks.items()}}
    with log.open("a") as out:
        out.write(json.dumps(record) + "\n")


def save(
    directory: Path,
    loader: StatefulDataLoader,
    rank: int,
    world_size: int,
    meta: dict[str, Any],
    delivery: Any = None,
) -> None:
    """A checkpoint; ``delivery`` (dataset, log path, facts): checked first."""
    directory.mkdir(parents=True, exist_ok=True)
    state = loader.state_dict()
    write_json(directory / f"loader-rank{rank}.json", state)
    states = gathered(state, world_size)
    if rank == 0:
        if delivery is not None:
            check_delivery(delivery[0], states, delivery[1], at="checkpoint", **delivery[2])
        write_json(directory / "job.json", shardcache.job_state(states))
        write_json(directory / "meta.json", meta)  # last: the checkpoint is complete
    if world_size > 1:
        dist.barrier()


class Signalled:
    """SIGUSR1 (SLURM's ``--signal``) as an event, and when it first arrived."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.at: float | None = None  # time.time()

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._handle)

    def _handle(self, *_: object) -> None:
        if self.at is None:
            self.at = time.time()
        self.event.set()


def install_signal_handlers(args: argparse.Namespace) -> Signalled:
    """SIGUSR1 as :class:`Signalled` (with ``--checkpoint-on-signal``); on SIGTERM (torchrun
    stops the other ranks when one fails) the stacks of every thread, then the default."""
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    signalled = Signalled()
    if args.checkpoint_on_signal:
        signalled.install()
    return signalled


def make_model(world_size: int) -> Any:
    """A step of a tiny model (DDP when distributed): ``step(batch_size)``."""
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(4, 1)
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch_size: int) -> None:
        optimizer.zero_grad()
        model(torch.ones(batch_size, 4)).square().mean().backward()  # the all-reduce
        optimizer.step()

    return step


def make_dataset(args: argparse.Namespace) -> Any:
    cache = shardcache.ShardCache(args.cache)
    if args.mixture_epoch_size is None:
        return shardcache.ResumableDataset(
            args.spec,
            seed=args.seed,
            shuffle_buffer=args.shuffle_buffer,
            cache=cache,
            lock=args.lock,
        )
    sources = []
    for part in args.spec.split(","):
        name, weight, spec = part.split("=", 2)
        sources.append(shardcache.Source(spec, weight=float(weight), name=name))
    schedule = None
    if args.schedule is not None:
        schedule = [
            entry if isinstance(entry, dict) else [shardcache.Step(at, w) for at, w in entry]
            for entry in json.loads(args.schedule)
        ]
    return shardcache.MixtureDataset(
        sources,
        epoch_size=args.mixture_epoch_size,
        seed=args.seed,
        shuffle_buffer=args.shuffle_buffer,
        cache=cache,
        schedule=schedule,
    )


def make_loader(args: argparse.Namespace, dataset: Any) -> StatefulDataLoader:
    return StatefulDataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        collate_fn=keys_of,
        # A stuck worker fails its rank with the DataLoader's error, before a collective
        # times out on the other ranks without saying why; its stacks tell where it is.
        timeout=args.timeout / 2 if args.workers else 0,
        worker_init_fn=stacks_on_sigusr2 if args.workers else None,
        multiprocessing_context=args.start_method if args.workers else None,
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="a shard spec, or NAME=WEIGHT=SPEC,...")
    parser.add_argument(
        "--mixture-epoch-size",
        type=int,
        default=None,
        help="read --spec's sources (NAME=WEIGHT=SPEC, comma-separated) as a MixtureDataset",
    )
    parser.add_argument("--schedule", default=None, help="the mixture's schedule, as JSON")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--out", required=True, type=Path)
    # --log-as under torchrun: its own parser takes "--run..." for its "--run-path".
    parser.add_argument("--log-as", "--run", dest="run", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--start-method",
        choices=["fork", "forkserver", "spawn"],
        default="fork",
        help="how the DataLoader starts its workers (fork: torch's default on Linux)",
    )
    parser.add_argument("--batch-size", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--shuffle-buffer", type=int, default=5)
    parser.add_argument("--checkpoint-at", type=int, nargs="*", default=[])
    parser.add_argument("--then-wait", action="store_true")
    parser.add_argument("--ckpt-prefix", default="ckpt-")
    parser.add_argument("--check-delivery", action="store_true")
    parser.add_argument("--checkpoint-on-signal", action="store_true")
    parser.add_argument("--wait-for-signal-at", type=int, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--lock", default=None, help="the dataset lockfile (lock=)")
    parser.add_argument("--model", action="store_true", help="step a DDP model each batch")
    parser.add_argument("--report", action="store_true", help="write each epoch's job report")
    parser.add_argument(
        "--timeout", type=float, default=COLLECTIVE_TIMEOUT, help="collective timeout (s)"
    )
    return parser.parse_args()


def resume(
    args: argparse.Namespace, loader: StatefulDataLoader, dataset: Any, world_size: int, rank: int
) -> int | None:
    """Load ``--resume``'s checkpoint, if it holds one; returns its epoch (None: none)."""
    if args.resume is None or not (args.resume / "meta.json").exists():
        return None
    meta = json.loads((args.resume / "meta.json").read_text())
    if (meta["world_size"], meta["workers"]) == (world_size, args.workers):
        state = json.loads((args.resume / f"loader-rank{rank}.json").read_text())
        loader.load_state_dict(state)  # exact: each worker gets its own state back
    else:  # elastic: every consumer's state, dealt out to the new layout
        dataset.load_state_dict(json.loads((args.resume / "job.json").read_text()))
    return int(meta["epoch"])


def end_epoch(
    args: argparse.Namespace,
    dataset: Any,
    loader: StatefulDataLoader,
    run: str,
    epoch: int,
    step: int,
) -> None:
    """After an epoch's last batch: the delivery check over every rank's state, the report."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.check_delivery:
        states = gathered(loader.state_dict(), world_size)
        if rank == 0:
            log = args.out / f"delivery-{run}.jsonl"
            check_delivery(dataset, states, log, at="end of epoch", epoch=epoch, step=step)
    if args.report:
        report = shardcache.log_epoch_summary(epoch)
        if rank == 0:
            write_json(args.out / f"report-{run}-epoch{epoch}.json", report)


def main() -> int:
    args = parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank() if world_size > 1 else 0
    step_model = make_model(world_size) if args.model else None

    signalled = install_signal_handlers(args)

    dataset = make_dataset(args)
    stacks_on_sigusr2()
    loader = make_loader(args, dataset)
    epoch = resume(args, loader, dataset, world_size, rank)
    resumed = epoch is not None
    epoch = epoch or 0

    run = args.run.format(restart=os.environ.get("SLURM_RESTART_COUNT", "0"))
    log = (args.out / f"keys-{run}-rank{rank}.jsonl").open("a")
    checks = args.out / f"delivery-{run}.jsonl"
    step, waited = 0, False
    for epoch in range(epoch, args.epochs):  # noqa: B020 (resumes the loop variable)
        dataset.set_epoch(epoch)
        for keys in watched(loader):
            step += 1
            if step_model is not None:
                step_model(len(keys))
            log.write(json.dumps({"epoch": epoch, "step": step, "keys": keys}) + "\n")
            log.flush()
            meta = {"epoch": epoch, "world_size": world_size, "workers": args.workers}
            if step in args.checkpoint_at:
                delivery = (dataset, checks, {"epoch": epoch, "step": step})
                save(
                    args.out / f"{args.ckpt_prefix}{step}",
                    loader,
                    rank,
                    world_size,
                    meta,
                    delivery if args.check_delivery else None,
                )
                if args.then_wait and step == max(args.checkpoint_at):
                    (args.out / f"killable-{run}-rank{rank}").write_text(str(os.getpid()))
                    threading.Event().wait(KILL_WAIT)
                    print("kill point: not killed in time", file=sys.stderr)
                    return 3
            if step == args.wait_for_signal_at and not resumed:
                # A job that reaches its time limit: wait (bounded) for SLURM's signal.
                (args.out / f"waiting-{run}").write_text(str(os.getpid()))
                waited = True
                if not signalled.event.wait(KILL_WAIT):
                    print("no SIGUSR1 arrived", file=sys.stderr)
                    return 4
            if signalled.event.is_set():
                save(args.out / "ckpt-signal", loader, rank, world_size, meta)
                record = {"received_at": signalled.at, "step": step, "waited": waited}
                write_json(args.out / f"signalled-{run}-rank{rank}.json", record)
                print(f"SIGUSR1: checkpoint after step {step}, requeueing", file=sys.stderr)
                job = os.environ["SLURM_JOB_ID"]
                subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
                return 0
        end_epoch(args, dataset, loader, run, epoch, step)
    (args.out / f"done-{run}-rank{rank}").write_text(str(step))
    if world_size > 1:
        del step_model  # the DDP model holds the process group: see end_process_group
        end_process_group()
    return 0


if __name__ == "__main__":
    exit_at_once(main())
