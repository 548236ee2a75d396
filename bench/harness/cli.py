"""shardcache benchmarks B1-B11 and B13-B16 against their peers; writes bench/results.{md,json}.

    python -m bench [--size tiny|full] [--out DIR] [--only B2,B6]
    python -m bench --only B14 --merge    # re-measure one scenario into results.json

Every timed scenario reports medians of several repetitions and ratios to its peer;
shaped scenarios go through a FaultProxy (own process) in front of a moto server (own
process) and report CPU use next to the numbers. Peers that are not installed in the running
venv (s3torchconnector, litdata, Mosaic Streaming: scripts/bench installs them in .venv-bench)
are reported as "not installed".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench import studies
from bench.harness.registry import SCENARIOS
from bench.harness.report import merge, merge_base, render, write_report
from bench.scenarios.ceiling import server_ceiling
from bench.support.common import SIZES, Bench
from bench.support.infra import machine


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", default=str(Path(__file__).parents[1]))
    parser.add_argument("--only", default="", help="comma-separated scenario ids")
    parser.add_argument("--render", action="store_true", help="only rewrite results.md from .json")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only the --only scenarios' results in OUT/results.json, keeping the rest",
    )
    return parser


def _measure(b: Bench, sid: str, work: Path, stamp: bool) -> dict[str, Any]:
    """Scenario ``sid``'s result (or its error), with the server and ``work`` reset after it;
    ``stamp``: say when and on how busy a machine it was measured (a ``--merge`` run)."""
    t0, at, load = time.monotonic(), time.time(), os.getloadavg()[0]
    try:
        res = SCENARIOS[sid][1](b)
    except Exception as exc:  # one scenario's failure must not hide the others
        traceback.print_exc()
        res = {"error": f"{type(exc).__name__}: {exc}"}
    b.s3.reset()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    if stamp:
        res["measured"] = {"started": at, "load_avg": round(load, 2)}
    print(sid, f"{time.monotonic() - t0:.1f}s", json.dumps(res), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios (all, or ``--only``) and write ``OUT/results.{json,md}``; 1 if one
    of them failed."""
    args = _parser().parse_args(argv)
    out = Path(args.out)
    if args.render:
        report = json.loads((out / "results.json").read_text())
        (out / "results.md").write_text(render(report))
        return 0
    only = [s.strip().upper() for s in args.only.split(",") if s.strip()] or list(SCENARIOS)
    base = None
    if args.merge:
        if unknown := [sid for sid in only if sid not in SCENARIOS]:
            raise SystemExit(f"--merge: no scenario {', '.join(unknown)}")
        base = merge_base(out, args.size)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shardcache-bench-"))
    started = time.time()
    b = Bench(args.size, work)
    report: dict[str, Any] = {
        "size": args.size,
        "started": started,
        "machine": machine(),
        "link": b.cfg["link"].describe(),
        "results": {},
    }
    print(json.dumps(report["machine"]), flush=True)
    try:
        report["server_ceiling"] = server_ceiling(b)
        print("server ceiling", report["server_ceiling"], flush=True)
        for sid in only:
            report["results"][sid] = _measure(b, sid, work, stamp=base is not None)
    finally:
        b.close()
        shutil.rmtree(work, ignore_errors=True)
    report["duration_s"] = time.time() - started
    if base is not None:
        report = merge(base, report["results"])
    else:  # the studies (python -m bench.studies) are no scenario: keep them
        report = studies.carried_over(out / "results.json", report)
    write_report(out, report)
    failed = [s for s, r in report["results"].items() if "error" in r or r.get("row_errors")]
    if failed:
        print(f"scenarios with errors (see the table): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
