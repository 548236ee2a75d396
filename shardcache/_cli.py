"""The ``shardcache`` command (also ``python -m shardcache``).

Exit codes: 0 success, 1 a shardcache error or a partial failure (some shards failed to
warm, bad shards found by ``verify``; the output says which), 2 usage error (one line on
stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from ._config import Settings
from ._config_display import format_setting
from ._config_parse import parse_size
from ._errors import ConfigError, ShardCacheError, UrlError
from ._redact import RedactingFilter

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EVICT_LIST_LIMIT = 20  # removed shards listed by "evict" (all of them with --json)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one clear line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class UsageError(Exception):
    """A usage error found after parsing (reported like argparse's: one line, exit 2)."""


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
        return value

    return parse


_positive_int, _non_negative_int = _int_at_least(1), _int_at_least(0)


def _size(text: str) -> int:
    try:
        return parse_size(text, "--max-bytes")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(_one_line(exc)) from None


def _command(
    commands: Any, name: str, help: str, description: str, examples: Sequence[str]
) -> argparse.ArgumentParser:
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    return commands.add_parser(  # type: ignore[no-any-return]
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _cache_options(parser: argparse.ArgumentParser, *, rank: bool = True) -> None:
    group = parser.add_argument_group("cache")
    group.add_argument(
        "--cache-dir", type=Path, help="cache root (default: SHARDCACHE_DIR, else $TMPDIR/...)"
    )
    group.add_argument(
        "--scope", choices=("rank", "node"), help="rank or node cache (default: SHARDCACHE_SCOPE)"
    )
    if rank:
        group.add_argument(
            "--rank",
            type=_non_negative_int,
            help="with rank scope: whose rank-<N> directory (default: this process's rank)",
        )


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardcache",
        description="Fast, safe local caching of sharded training data from S3 / fsspec URLs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  shardcache warm 's3://bucket/train-{000000..000127}.tar' --threads 16\n"
        "  shardcache index 's3://bucket/train-{000000..000127}.tar' -o train.index.json\n"
        "  shardcache status\n"
        "  shardcache clean\n"
        "  shardcache evict --max-bytes 500G\n"
        "  shardcache verify\n"
        "  shardcache config --json\n"
        "  shardcache report /shared/metrics/job-1234 --plot wait.png\n"
        "  shardcache demo\n"
        "\nexit codes: 0 ok, 1 failed (or some shards failed), 2 usage error",
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    config = commands.add_parser(
        "config",
        help="print the resolved settings and where each came from",
        description="Print every setting, its value and its source: argument, SHARDCACHE_* "
        "variable, launcher variable (torchrun / SLURM) or default.",
        epilog="examples:\n  shardcache config\n  SHARDCACHE_SCOPE=node shardcache config --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_argument("--json", action="store_true", help="machine-readable output")
    config.set_defaults(func=_cmd_config)

    demo = commands.add_parser(
        "demo",
        help="read a small WebDataset through the cache and report",
        description="Start an embedded S3 (moto server on 127.0.0.1), write a small "
        "WebDataset, read it with a WebDataset pipeline and a DataLoader through the cache "
        "(shardcache.tarfile_to_samples) and print a report. A second run shows all hits. "
        "With --source, run on real data instead (AWS_* env applies; samples are counted, "
        "not decoded). Progress on stderr (a bar on a terminal, else a line every 5 s), the "
        "report on stdout.",
        epilog="examples:\n  shardcache demo\n"
        "  shardcache demo --source 's3://bucket/train-{000000..000015}.tar'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--source", help="shard spec to fetch instead of the embedded dataset")
    demo.add_argument("--cache-dir", type=Path, help="cache root (default: SHARDCACHE_DIR)")
    demo.add_argument("--shards", type=int, default=16, help="embedded dataset: shard count")
    demo.add_argument("--threads", type=int, help="parallel downloads (SHARDCACHE_THREADS)")
    demo.add_argument("--fresh", action="store_true", help="empty the demo's cache first")
    demo.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    demo.add_argument("--json", action="store_true", help="machine-readable report")
    demo.set_defaults(func=_cmd_demo)

    _add_warm(commands)
    _add_index(commands)
    _add_maintenance(commands)
    _add_report(commands)
    for command in commands.choices.values():  # -v after the command too: "warm -v ..."
        command.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,  # absent: the value before the command stands
            help="log debug details",
        )
    return parser


def _add_warm(commands: Any) -> None:
    warm = _command(
        commands,
        "warm",
        "fetch shards into the cache ahead of training",
        "Fetch every shard of the specs into the cache, several at a time, with a progress "
        "bar (plain progress lines every 5 s when stderr is not a terminal). A shard that "
        "fails does not stop the others, but the run stops early after --max-failures "
        "failed shards, or when 5 shards in a row fail with the same error that is not about "
        "the shard itself (the cache directory, credentials, an unreachable store). Prints a "
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
        "warming only this task's shards avoids.",
        [
            "shardcache warm 's3://bucket/train-{000000..000127}.tar'",
            "shardcache warm --from-file shards.txt --threads 16 --cache-dir /local/ssd/cache",
            "srun --ntasks-per-node=8 shardcache warm 's3://b/train-{0000..1023}.tar' --scope node",
            "torchrun --nproc-per-node 8 -m shardcache warm 's3://b/train-{0000..1023}.tar' "
            "--split dataset --index s3://b/train.index.json --seed 7",
        ],
    )
    _spec_arguments(warm)
    warm.add_argument(
        "--threads", type=_positive_int, help="parallel downloads (default: SHARDCACHE_THREADS)"
    )
    warm.add_argument(
        "--max-failures",
        type=_positive_int,
        metavar="N",
        help="stop after N shards failed (default: no limit; warm always stops when 5 shards "
        "in a row fail with the same error that is not about the shard itself)",
    )
    warm.add_argument("--json", action="store_true", help="machine-readable summary")
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
        "--seed", type=_non_negative_int, metavar="N", help="the dataset's seed (default 0)"
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
    _cache_options(warm, rank=False)
    warm.set_defaults(func=_cmd_warm)


def _spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="*", metavar="SPEC", help="URL or brace pattern")
    parser.add_argument(
        "--from-file",
        action="append",
        default=[],
        metavar="F",
        help="manifest: one URL or pattern per line (# comments), or a JSON list (repeatable)",
    )


def _add_index(commands: Any) -> None:
    index = _command(
        commands,
        "index",
        "write the sample index of a shard list (for ResumableDataset, warm --split dataset)",
        "Fetch every shard of the specs through the cache, several at a time, read where "
        "each sample starts, and write the sample index of the shard list to FILE (a local "
        "path, written atomically, or an fsspec URL such as s3://bucket/train.index.json). "
        "shardcache.ResumableDataset(SPEC, index=FILE) then splits epochs by samples "
        "without fetching every shard first, and 'shardcache warm --split dataset --index "
        "FILE' warms exactly each task's shards. Run it once for a shard list (not on every "
        "rank), and again when the shards change. The shards stay cached, so a later warm "
        "or training on this machine finds them. Progress on stderr as 'warm' shows it, a "
        "summary on stdout (--json: as JSON). The first shard that cannot be fetched or "
        "read stops the run: exit code 1 and nothing written. Shards that hold no sample "
        "are reported as a warning.",
        [
            "shardcache index 's3://bucket/train-{000000..000127}.tar' -o train.index.json",
            "shardcache index --from-file shards.txt -o s3://bucket/train.index.json --json",
        ],
    )
    _spec_arguments(index)
    index.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="where to write the index: a local path or an fsspec URL",
    )
    index.add_argument(
        "--threads", type=_positive_int, help="parallel downloads (default: SHARDCACHE_THREADS)"
    )
    index.add_argument("--json", action="store_true", help="machine-readable summary")
    _cache_options(index, rank=False)
    index.set_defaults(func=_cmd_index)


def _add_maintenance(commands: Any) -> None:
    status = _command(
        commands,
        "status",
        "show entries, disk, locks held, stale locks and orphan files",
        "Show the cache directory's shards and bytes, the free disk, downloads in progress, "
        "every lock held right now and by whom (host, pid, rank, phase, bytes, alive?), "
        "stale locks (leases of dead processes) and orphan files (temp files of killed "
        "downloads, metadata of shards that are gone), and the other scope directories of "
        "the root. Changes nothing. Exit code 1 when the scope directory does not exist (the "
        "message names the ones the root holds).",
        [
            "shardcache status",
            "shardcache status --json --scope node",
            "shardcache status --rank 3",
            "shardcache status --all",
        ],
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--all",
        action="store_true",
        help="every rank-N and node directory under the cache root, in one table",
    )
    _cache_options(status)
    status.set_defaults(func=_cmd_status)

    clean = _command(
        commands,
        "clean",
        "remove stale locks and orphan temp files",
        "Remove exactly what 'status' reports as stale or orphan, checking each item again "
        "right before removing it. Never removes a .lock file, a lock of a live holder, or "
        "a download of a living process. Safe to run while jobs use the cache.",
        [
            "shardcache clean",
            "shardcache clean --json --cache-dir /local/ssd/cache",
            "shardcache clean --all",
        ],
    )
    clean.add_argument("--json", action="store_true", help="machine-readable output")
    clean.add_argument(
        "--all", action="store_true", help="every rank-N and node directory under the cache root"
    )
    _cache_options(clean)
    clean.set_defaults(func=_cmd_clean)

    evict = _command(
        commands,
        "evict",
        "evict least-recently-used shards down to a size",
        "Remove least-recently-used shards until the cache (shards plus downloads in "
        "progress) fits in SIZE. Shards in use by a reader are never removed. Exit code 2 "
        "when neither --max-bytes nor SHARDCACHE_MAX_BYTES gives a size.",
        ["shardcache evict --max-bytes 500G", "SHARDCACHE_MAX_BYTES=1.5T shardcache evict"],
    )
    evict.add_argument(
        "--max-bytes",
        type=_size,
        metavar="SIZE",
        help="target size, e.g. 500G (default: SHARDCACHE_MAX_BYTES); 0 evicts all unused",
    )
    evict.add_argument("--json", action="store_true", help="machine-readable output")
    _cache_options(evict)
    evict.set_defaults(func=_cmd_evict)

    verify = _command(
        commands,
        "verify",
        "re-check cached shards against the remote (or a manifest); remove bad ones",
        "Check every cached shard: its size against the remote object's, its content against "
        "the object's full-object S3 checksum and a single-part object's ETag (MD5), and "
        "that the ETag has not changed since download; or, "
        "for URLs a JSON manifest lists with size / md5 / sha256, against those. Bad shards "
        "are removed (the next fetch downloads them again) and listed. Shards without a "
        "metadata record are reported as of unknown origin and left alone. Exit code 1 when "
        "a shard was bad or could not be checked, else 0. With --quick, only each shard's "
        "size against the one recorded when it was cached (nothing read, no source asked). "
        "Progress on stderr as 'warm' shows it, the report on stdout.",
        [
            "shardcache verify",
            "shardcache verify --manifest shards.json --threads 8",
            "shardcache verify --quick",
        ],
    )
    verify.add_argument(
        "--quick",
        action="store_true",
        help="only compare each shard's size with its metadata record (local, seconds)",
    )
    verify.add_argument(
        "--manifest", metavar="F", help='JSON manifest of {"url", "size", "md5"/"sha256"}'
    )
    verify.add_argument(
        "--threads", type=_positive_int, help="parallel checks (default: SHARDCACHE_THREADS)"
    )
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    _cache_options(verify)
    verify.set_defaults(func=_cmd_verify)


def _add_report(commands: Any) -> None:
    report = _command(
        commands,
        "report",
        "one table of a job's ranks from their metrics files (SHARDCACHE_METRICS)",
        "Read every *.jsonl file under DIR (recursively): the shardcache.metrics records "
        "the ranks of a job wrote with SHARDCACHE_METRICS=DIR. Prints per rank, worst "
        "first (highest data-wait share, then most stalls and retries), then a totals row: "
        "data-wait share, samples and samples/s, shards, cache hits, misses, shared, bytes "
        "downloaded and served, GETs, retries, integrity re-downloads, lock waits, stall "
        "warnings/errors; then the worst ranks' retries by cause, lock waits and stalls, and "
        "the slowest shards. Several jobs in DIR: one table each (--job picks one). Lines "
        "that are not records are skipped and counted. Exit code 1 when DIR holds no "
        "records or a record of a newer schema version. --plot draws data-wait share and "
        "samples/s per rank over time into a PNG (needs the plot extra: matplotlib).",
        [
            "shardcache report /shared/metrics/job-1234",
            "shardcache report metrics/ --epoch 2 --top 20",
            "shardcache report metrics/ --plot wait.png",
            "shardcache report metrics/ --json",
        ],
    )
    report.add_argument("dir", type=Path, metavar="DIR", help="directory of *.jsonl files")
    report.add_argument("--json", action="store_true", help="machine-readable output (every rank)")
    report.add_argument(
        "--plot", type=Path, metavar="OUT.png", help="draw wait share and samples/s over time"
    )
    report.add_argument("--epoch", type=_non_negative_int, help="only this epoch's records")
    report.add_argument("--job", metavar="ID", help="only this job id's records")
    report.add_argument(
        "--top",
        type=_non_negative_int,
        default=10,
        metavar="K",
        help="rows for the K worst ranks and the K slowest shards (default 10; 0: all)",
    )
    report.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from ._report import build_report
    from ._report_text import format_report

    if not args.dir.is_dir():
        raise UsageError(f"{args.dir} is not a directory (give the SHARDCACHE_METRICS directory)")
    if args.plot is not None and not args.plot.parent.is_dir():
        raise UsageError(f"--plot {args.plot}: directory {args.plot.parent} does not exist")
    report = build_report(args.dir, epoch=args.epoch, job=args.job)
    if args.plot is not None:
        from ._report_plot import plot

        plot(report.jobs[0], args.plot)  # before any output: a missing extra fails cleanly
    if args.json:
        _write_json(report.as_json(args.top))
    else:
        sys.stdout.write(format_report(report, args.top) + "\n")
    if args.plot is not None:
        sys.stdout.flush()
        several = " (the latest of several jobs; --job picks one)" if len(report.jobs) > 1 else ""
        sys.stderr.write(f"report: plotted job {report.jobs[0].job_id}{several} to {args.plot}\n")
    return EXIT_OK


def _cmd_config(args: argparse.Namespace) -> int:
    settings, errors = Settings.diagnose()
    rows = settings.describe()
    if args.json:
        out = {}
        for name, env, value, source in rows:
            text = format_setting(name, value)
            out[name] = {"value": _jsonable(value), "text": text, "env": env, "source": source}
            if name in errors:
                out[name] |= {"value": None, "text": None, "error": _one_line(errors[name])}
        _write_json(out)
    else:
        width = max(len(name) for name, *_ in rows)
        for name, env, value, source in rows:
            shown = "INVALID (below)" if name in errors else format_setting(name, value)
            sys.stdout.write(f"{name:<{width}}  {shown:<40}  {source}  [{env}]\n")
            if name in errors:
                sys.stdout.write(f"  error: {_one_line(errors[name])}\n")
    if errors:
        sys.stderr.write(
            f"shardcache config: invalid: {', '.join(errors)} (the error is shown under each; "
            "the other settings are as resolved)\n"
        )
        return EXIT_USAGE
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import format_report, run_demo

    report = run_demo(
        source=args.source,
        cache_dir=args.cache_dir,
        shards=args.shards,
        threads=args.threads,
        fresh=args.fresh,
        workers=args.workers,
        stream=sys.stderr,
    )
    if args.json:
        _write_json(report.as_json())
    else:
        sys.stdout.write(format_report(report) + "\n")
    return EXIT_OK if not report.failed else EXIT_FAILED


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {"cache_dir": args.cache_dir, "scope": args.scope}
    if getattr(args, "rank", None) is not None:
        overrides["rank"] = args.rank
    return Settings.resolve(**overrides)


def _cache(args: argparse.Namespace) -> Any:
    from ._cache import ShardCache

    return ShardCache(settings=_settings(args))


def _specs(args: argparse.Namespace) -> list[str]:
    """The SPEC arguments and ``--from-file`` manifests, as expand_urls takes them."""
    specs = list(args.specs) + [f"@{path}" for path in args.from_file]
    if not specs:
        raise UsageError("give at least one SPEC or --from-file F")
    return specs


_DATASET_OPTIONS = ("--index", "--seed", "--no-shuffle-shards", "--remainder")


def _cmd_warm(args: argparse.Namespace) -> int:
    from ._urls import expand_urls
    from .distributed import rank_info
    from .warm import WarmResult, plan_dataset_warm, plan_warm, warm

    specs = _specs(args)
    values = (args.index, args.seed, None if args.shuffle_shards else True, args.remainder)
    given = [flag for flag, v in zip(_DATASET_OPTIONS, values, strict=True) if v is not None]
    if args.split != "dataset" and given:
        raise UsageError(f"{', '.join(given)}: only with --split dataset")
    if args.split == "dataset" and args.index is None:
        raise UsageError(
            "--split dataset needs --index FILE: make the shard list's sample index first "
            "with 'shardcache index SPEC -o FILE' (without it every shard would be "
            "downloaded to split the epoch by samples)"
        )
    urls = expand_urls(specs)
    cache = _cache(args)
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
    if not plan.active or not plan.urls:
        if args.json:
            _write_json({"plan": plan.reason, **WarmResult(settings.scope_dir, 0).as_json()})
        else:
            sys.stdout.write(f"warm: nothing to do ({plan.reason})\n")
        return EXIT_OK
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
        _write_json({"plan": plan.reason, **result.as_json()})
    else:
        sys.stdout.write(result.summary() + "\n")
    return EXIT_FAILED if result.failed or result.not_attempted else EXIT_OK


def _dataset(args: argparse.Namespace, specs: list[str], cache: Any) -> Any:
    """The training's ResumableDataset as the --split dataset arguments describe it (its
    rank and world size detected, as in training)."""
    from ._extras import require_extras

    require_extras("shardcache warm --split dataset", "torch")
    from ._resumable import ResumableDataset

    return ResumableDataset(
        specs,
        seed=0 if args.seed is None else args.seed,
        shuffle_shards=args.shuffle_shards,
        remainder=args.remainder or "pad",
        index=args.index,
        cache=cache,
    )


def _cmd_index(args: argparse.Namespace) -> int:
    from ._sample_index import index_document
    from ._urls import expand_urls
    from .warm import build_index

    urls = expand_urls(_specs(args))
    target = args.output
    _check_output(target)
    cache = _cache(args)
    threads = args.threads or cache.settings.threads
    sys.stderr.write(
        f"index: {len(urls)} shards through {cache.settings.scope_dir} with {threads} threads\n"
    )
    sys.stderr.flush()
    result = build_index(cache, urls, threads=threads, stream=sys.stderr)
    _write_index(target, index_document(result.index, urls))
    if args.json:
        _write_json(result.as_json(target))
    else:
        sys.stdout.write(result.summary(target) + "\n")
    return EXIT_OK


def _check_output(target: str) -> None:
    """``-o`` must be a file in an existing local directory, or a URL of a known fsspec
    protocol (checked before anything is fetched)."""
    if "://" in target and not target.startswith("file://"):
        import fsspec

        protocol = target.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise UsageError(f"-o {target}: {_one_line(exc)}") from None
        return
    path = Path(target.removeprefix("file://"))
    if path.is_dir():
        raise UsageError(f"-o {target} is a directory: give the index file's path")
    if not path.parent.is_dir():
        raise UsageError(f"-o {target}: directory {path.parent} does not exist")


def _write_index(target: str, document: dict[str, Any]) -> None:
    from ._errors import SampleIndexError
    from ._sample_index import write_index

    try:
        write_index(target, document)
    except OSError as exc:  # fsspec targets (local ones raise SampleIndexError)
        raise SampleIndexError(
            f"cannot write the sample index {target}: {type(exc).__name__}: "
            f"{_one_line(exc)}; check the bucket and the credentials, or choose another -o",
            path=target,
        ) from None


def _write_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _emit(report: Any, as_json: bool) -> None:
    if as_json:
        _write_json(report.as_json())
    else:
        sys.stdout.write(report.format() + "\n")


def _all_scopes(args: argparse.Namespace) -> bool:
    """Whether ``--all`` was given (never with ``--scope`` or ``--rank``)."""
    if args.all and (args.scope is not None or args.rank is not None):
        raise UsageError(
            f"--all covers every scope: give {args.command} --all without --scope or --rank"
        )
    return bool(args.all)


def _cmd_status(args: argparse.Namespace) -> int:
    from ._maintenance import status, status_all

    _emit(status_all(_settings(args)) if _all_scopes(args) else status(_cache(args)), args.json)
    return EXIT_OK


def _cmd_clean(args: argparse.Namespace) -> int:
    from ._maintenance import clean, clean_all

    report = clean_all(_settings(args)) if _all_scopes(args) else clean(_cache(args))
    _emit(report, args.json)
    return EXIT_FAILED if report.failed else EXIT_OK


def _cmd_evict(args: argparse.Namespace) -> int:
    from ._maintenance import require_scope_dir
    from ._units import format_bytes

    cache = _cache(args)
    limit = args.max_bytes if args.max_bytes is not None else cache.settings.max_bytes
    if limit is None:
        raise UsageError("give --max-bytes SIZE (e.g. 500G) or set SHARDCACHE_MAX_BYTES")
    require_scope_dir(cache.settings)
    report = cache.evict(limit)
    if args.json:
        out = {
            "scope_dir": str(cache.settings.scope_dir),
            "max_bytes": limit,
            "removed": [
                {"path": str(e.path), "url": e.url, "size": e.size, "last_used": e.last_used}
                for e in report.removed
            ],
            "freed_bytes": report.freed_bytes,
            "kept_bytes": report.kept_bytes,
            "in_use": report.in_use,
        }
        _write_json(out)
        return EXIT_OK
    lines = [
        f"evict {cache.settings.scope_dir} to {format_bytes(limit)} ({limit} bytes): removed "
        f"{len(report.removed)} shards ({format_bytes(report.freed_bytes)} freed), "
        f"{format_bytes(report.kept_bytes)} kept, {report.in_use} in use skipped"
    ]
    shown = report.removed[:EVICT_LIST_LIMIT]
    lines += [f"  {e.url or e.path} ({format_bytes(e.size)})" for e in shown]
    if len(report.removed) > len(shown):
        lines.append(f"  ... and {len(report.removed) - len(shown)} more (--json lists all)")
    sys.stdout.write("\n".join(lines) + "\n")
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from ._verify import verify

    report = verify(
        _cache(args), args.manifest, threads=args.threads, quick=args.quick, stream=sys.stderr
    )
    _emit(report, args.json)
    return EXIT_FAILED if report.failed else EXIT_OK


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardcache`` console script."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:  # -v: botocore logs request headers
        handler.addFilter(RedactingFilter())
    try:
        return int(args.func(args))
    except UsageError as exc:
        prog = f"shardcache {args.command}"
        sys.stderr.write(f"{prog}: error: {exc} (see {prog} --help)\n")
        return EXIT_USAGE
    except (ConfigError, UrlError) as exc:
        sys.stderr.write(f"shardcache: {type(exc).__name__}: {_one_line(exc)}\n")
        return EXIT_USAGE
    except ShardCacheError as exc:
        sys.stderr.write(f"shardcache: {type(exc).__name__}: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write("shardcache: interrupted\n")
        return 130
