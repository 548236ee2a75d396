"""``shardcache warm``: fetch a shard list into the cache ahead of training, this task's
share of it (``--split``), or what a ``ResumableDataset`` reads through this task's cache
(``--split dataset``); the run itself, its progress and its failures: ``warm``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import common


def add(commands: Any) -> None:
    warm = common.command(
        commands,
        "warm",
        "fetch shards into the cache ahead of training",
        "Fetch every shard of the specs into the cache, several at a time, with a progress "
        "bar (plain progress lines every 5 s when stderr is not a terminal). A shard that "
        "fails does not stop the others, but the run stops early after --max-failures "
        "failed shards, at the first error about the whole store (a missing bucket, a "
        "refused connection), or when 5 shards in a row fail with the same error that is not "
        "about the shard itself (credentials, a store that keeps failing). Prints a "
        "summary (--json: as JSON), failures grouped by error; exit code 0 when every shard "
        "is cached, 1 when some failed or were not attempted, 2 on usage errors. Shards "
        "already cached are hits, so a second run is fast.\n\n"
        "--split auto (the default) under torchrun or SLURM: with rank scope each rank warms "
        "its own share, shards[RANK::WORLD_SIZE] (what shardcache.split_by_node gives it), "
        "into its own rank-<RANK> directory; with node scope only local rank 0 of each node "
        "works, warming the shares of all the node's ranks (ranks are assumed contiguous per "
        "node; if the ranks per node are unknown, everything), and the other local ranks "
        "print 'nothing to do'. --split none: every task warms every shard. Outside a "
        "launcher the two are the same.\n\n"
        "--split dataset: warm what shardcache.ResumableDataset(SPEC, seed=, "
        "shuffle_shards=, remainder=, index=) reads through this task's cache in every "
        "epoch (its cache_urls()): with rank scope this rank's shards, with node scope "
        "(local rank 0 only, as above) the node's. Give the training's --seed, "
        "--no-shuffle-shards and --remainder. It needs --index FILE, the shard list's "
        "sample index made by 'shardcache index': the split is by samples, and without an "
        "index every shard would have to be downloaded to count them, which is what "
        "warming only this task's shards avoids.\n\n"
        "--dry-run (or --list) prints the URLs this task would warm, one a line on stdout "
        "(--json: the plan and the list), and reads none of them: nothing is downloaded "
        "and no cache directory is made.",
        [
            "shardcache warm 's3://bucket/train-{000000..000127}.tar'",
            "shardcache warm --from-file shards.txt --threads 16 --cache-dir /local/ssd/cache",
            "srun --ntasks-per-node=8 shardcache warm 's3://b/train-{0000..1023}.tar' --scope node",
            "torchrun --nproc-per-node 8 -m shardcache warm 's3://b/train-{0000..1023}.tar' "
            "--split dataset --index s3://b/train.index.json --seed 7",
            "RANK=3 WORLD_SIZE=8 shardcache warm 's3://b/train-{0000..1023}.tar' --dry-run",
        ],
    )
    common.spec_arguments(warm)
    warm.add_argument(
        "--threads",
        type=common.positive_int,
        help="parallel downloads (default: SHARDCACHE_THREADS)",
    )
    warm.add_argument(
        "--max-failures",
        type=common.positive_int,
        metavar="N",
        help="stop after N shards failed (default: no limit; warm always stops when 5 shards "
        "in a row fail with the same error that is not about the shard itself)",
    )
    warm.add_argument("--json", action="store_true", help="machine-readable summary")
    warm.add_argument(
        "--dry-run",
        "--list",
        dest="dry_run",
        action="store_true",
        help="print the URLs this task would warm (its --split share); read none of them",
    )
    warm.add_argument(
        "--split",
        choices=("auto", "none", "dataset"),
        default="auto",
        help="auto: this task's share under torchrun/SLURM (default); none: every shard; "
        "dataset: what ResumableDataset reads through this task's cache (needs --index)",
    )
    dataset = warm.add_argument_group(
        "--split dataset (the ResumableDataset arguments of the training)"
    )
    dataset.add_argument(
        "--index",
        metavar="FILE",
        help="sample index of the shard list (path or URL), made by 'shardcache index'; "
        "required with --split dataset",
    )
    dataset.add_argument(
        "--seed", type=common.non_negative_int, metavar="N", help="the dataset's seed (default 0)"
    )
    dataset.add_argument(
        "--no-shuffle-shards",
        dest="shuffle_shards",
        action="store_false",
        help="the dataset was made with shuffle_shards=False",
    )
    dataset.add_argument(
        "--remainder", choices=("pad", "drop"), help="the dataset's remainder (default pad)"
    )
    common.cache_options(warm, rank=False)
    warm.set_defaults(func=run)


_DATASET_OPTIONS = ("--index", "--seed", "--no-shuffle-shards", "--remainder")


def run(args: argparse.Namespace) -> int:
    from .._datasets.urls import expand_urls
    from ..distributed import rank_info
    from ..warm import WarmResult, plan_dataset_warm, plan_warm, warm

    specs = common.specs_of(args)
    values = (args.index, args.seed, None if args.shuffle_shards else True, args.remainder)
    given = [flag for flag, v in zip(_DATASET_OPTIONS, values, strict=True) if v is not None]
    if args.split != "dataset" and given:
        raise common.UsageError(f"{', '.join(given)}: only with --split dataset")
    if args.split == "dataset" and args.index is None:
        raise common.UsageError(
            "--split dataset needs --index FILE: make the shard list's sample index first "
            "with 'shardcache index SPEC -o FILE' (without it every shard would be "
            "downloaded to split the epoch by samples)"
        )
    urls = expand_urls(specs)
    cache = common.cache_for(args)
    settings = cache.settings
    info = rank_info()
    where = {
        "scope": settings.scope,
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "local_world_size": info.local_world_size,
    }
    idle = settings.scope == "node" and info.world_size > 1 and info.local_rank != 0
    if args.split == "dataset" and not idle:
        plan = plan_dataset_warm(_dataset(args, specs, cache), **where)
    else:  # an idle task of --split dataset gets --split auto's answer without the dataset
        plan = plan_warm(urls, split="auto" if args.split == "dataset" else args.split, **where)
    if args.dry_run:
        return _list(plan, args.json)
    if not plan.active or not plan.urls:
        if args.json:
            common.write_json({"plan": plan.reason, **WarmResult(settings.scope_dir, 0).as_json()})
        else:
            sys.stdout.write(f"warm: nothing to do ({plan.reason})\n")
        return common.EXIT_OK
    threads = args.threads or settings.threads
    sys.stderr.write(
        f"warm: {len(plan.urls)} shards ({plan.reason}) into {settings.scope_dir} "
        f"with {threads} threads\n"
    )
    sys.stderr.flush()
    result = warm(
        cache, plan.urls, threads=threads, stream=sys.stderr, max_failures=args.max_failures
    )
    if args.json:
        common.write_json({"plan": plan.reason, **result.as_json()})
    else:
        sys.stdout.write(result.summary() + "\n")
    return common.EXIT_FAILED if result.failed or result.not_attempted else common.EXIT_OK


def _list(plan: Any, as_json: bool) -> int:
    """``--dry-run``: the URLs ``plan`` would warm, on stdout; what they are, on stderr."""
    urls = plan.urls if plan.active else []
    if as_json:
        common.write_json({"plan": plan.reason, "dry_run": True, "urls": urls})
    else:
        sys.stderr.write(f"warm --dry-run: {len(urls)} shards ({plan.reason}); none read\n")
        sys.stdout.write("".join(f"{url}\n" for url in urls))
    return common.EXIT_OK


def _dataset(args: argparse.Namespace, specs: list[str], cache: Any) -> Any:
    """The training's ResumableDataset as the --split dataset arguments describe it (its
    rank and world size detected, as in training)."""
    from .._base.extras import require_extras

    require_extras("shardcache warm --split dataset", "torch")
    from .._datasets.resumable import ResumableDataset

    return ResumableDataset(
        specs,
        seed=0 if args.seed is None else args.seed,
        shuffle_shards=args.shuffle_shards,
        remainder=args.remainder or "pad",
        index=args.index,
        cache=cache,
    )
