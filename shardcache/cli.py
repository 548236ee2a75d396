"""The ``shardcache`` command (also ``python -m shardcache``).

Exit codes: 0 success, 1 a shardcache error (the message says what to do), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import Settings
from .errors import ConfigError, ShardCacheError, UrlError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one clear line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardcache",
        description="Fast, safe local caching of sharded training data from S3 / fsspec URLs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  shardcache config --json\n  shardcache demo\n",
    )
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
        "not decoded).",
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
    demo.set_defaults(func=_cmd_demo)
    return parser


def _cmd_config(args: argparse.Namespace) -> int:
    settings = Settings.resolve()
    rows = settings.describe()
    if args.json:
        out = {
            name: {"value": _jsonable(v), "env": env, "source": src} for name, env, v, src in rows
        }
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return EXIT_OK
    width = max(len(name) for name, *_ in rows)
    for name, env, value, source in rows:
        sys.stdout.write(f"{name:<{width}}  {_jsonable(value)!s:<40}  {source}  [{env}]\n")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import format_report, run_demo

    report = run_demo(
        source=args.source,
        cache_dir=args.cache_dir,
        shards=args.shards,
        threads=args.threads,
        fresh=args.fresh,
        workers=args.workers,
    )
    sys.stdout.write(format_report(report) + "\n")
    return EXIT_OK if not report.failed else EXIT_FAILED


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
    try:
        return int(args.func(args))
    except (ConfigError, UrlError) as exc:
        sys.stderr.write(f"shardcache: {type(exc).__name__}: {_one_line(exc)}\n")
        return EXIT_USAGE
    except ShardCacheError as exc:
        sys.stderr.write(f"shardcache: {type(exc).__name__}: {exc}\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write("shardcache: interrupted\n")
        return 130
