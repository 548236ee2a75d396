"""``shardcache report DIR``: one table of a job's ranks from their metrics files, as text
(``_ops.report_text``), JSON, or a plot (``_ops.report_plot``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from . import common


def add(commands: Any) -> None:
    report = common.command(
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
    report.add_argument("--epoch", type=common.non_negative_int, help="only this epoch's records")
    report.add_argument("--job", metavar="ID", help="only this job id's records")
    report.add_argument(
        "--top",
        type=common.non_negative_int,
        default=10,
        metavar="K",
        help="rows for the K worst ranks and the K slowest shards (default 10; 0: all)",
    )
    report.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .._ops.report import build_report
    from .._ops.report_text import format_report

    if not args.dir.is_dir():
        raise common.UsageError(
            f"{args.dir} is not a directory (give the SHARDCACHE_METRICS directory)"
        )
    if args.plot is not None and not args.plot.parent.is_dir():
        raise common.UsageError(f"--plot {args.plot}: directory {args.plot.parent} does not exist")
    report = build_report(args.dir, epoch=args.epoch, job=args.job)
    if args.plot is not None:
        from .._ops.report_plot import plot

        plot(report.jobs[0], args.plot)  # before any output: a missing extra fails cleanly
    if args.json:
        common.write_json(report.as_json(args.top))
    else:
        sys.stdout.write(format_report(report, args.top) + "\n")
    if args.plot is not None:
        sys.stdout.flush()
        job_id = report.jobs[0].job_id
        job = f"job {job_id}" if job_id is not None else "the records (they name no job id)"
        several = " (the latest of several jobs; --job picks one)" if len(report.jobs) > 1 else ""
        sys.stderr.write(f"report: plotted {job}{several} to {args.plot}\n")
    return common.EXIT_OK
