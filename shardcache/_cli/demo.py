"""``shardcache demo``: read a small WebDataset (an embedded S3, or ``--source``) through
the cache and print the demo's report (``_ops.demo`` runs it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from . import common


def add(commands: Any) -> None:
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
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .._ops.demo import format_report, run_demo

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
        common.write_json(report.as_json())
    else:
        sys.stdout.write(format_report(report) + "\n")
    return common.EXIT_OK if not report.failed else common.EXIT_FAILED
