"""``python -m bench.studies``: compute the studies into ``bench/results.json`` and rewrite
the benchmarks page's regions from it (see :mod:`bench.studies`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import docs_tables
from bench.studies import STUDIES, measure, merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies", description="Compute the studies into bench/results.json."
    )
    parser.add_argument("--only", default="", help="comma-separated study names")
    parser.add_argument("--results", type=Path, default=docs_tables.RESULTS)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(STUDIES)
    if unknown := [n for n in names if n not in STUDIES]:
        parser.error(f"no study {', '.join(unknown)}: choose from {', '.join(STUDIES)}")
    if not args.results.is_file():
        parser.error(f"{args.results} does not exist; run the benchmark harness first")
    fresh = {}
    for name in names:
        fresh[name] = measure(name)
        print(f"{name}: computed", flush=True)
    report = merged(json.loads(args.results.read_text()), fresh)
    args.results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"merged {', '.join(names)} into {args.results}")
    if args.results.resolve() == docs_tables.RESULTS:
        docs_tables.main([])
        print(f"rewrote the tables of {docs_tables.PAGE} from {docs_tables.RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
