"""Studies that count rather than time, merged into ``bench/results.json`` under ``studies``.

    python -m bench.studies                              # every study, into bench/results.json
    python -m bench.studies --only elastic-moves         # one study
    python -m bench.studies --only index-reads --results /tmp/results.json

A study is a script of its own in this package (``shuffle_quality``, ``elastic_moves``,
``index_reads``), run by ``python -m bench.studies`` at the size the benchmarks page shows.
Its figures are counts and entropies that do not depend on how busy the machine is, so a
study may be re-run at any time; timings are left out of what is stored. The benchmarks page
renders each study's region (``<!-- generated: shuffle-quality -->``) from the stored figures
with the script's own table. ``at_scale`` is a study too, of the page
docs/internals/at-scale-model.md: a model run by hand, not stored.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Study:
    module: str  # the script: its main_parser(), run(args) and table(figures)
    argv: tuple[str, ...]  # the size the page shows
    what: str  # the setup, for a reader of the page

    def script(self) -> Any:
        return importlib.import_module(self.module)


STUDIES: dict[str, Study] = {
    "shuffle-quality": Study(
        "bench.studies.shuffle_quality",
        (),
        "Mosaic Streaming's shuffle quality (its simulator's measure): the entropy of the "
        "differences between neighbouring sample indices plus that of neighbouring shard "
        "indices, in the order training consumes the samples; shardcache's order computed with "
        "its own split and shuffle buffer, Mosaic's with its own partition and shuffle "
        "functions at their defaults",
    ),
    "elastic-moves": Study(
        "bench.studies.elastic_moves",
        (),
        "shards of 40 to 157 samples, seed 0; caches keep their index (new ones start empty, "
        "removed ones are gone). Moved: the shards a cache reads after the change and did not "
        "before. At least: what the added caches must receive or the removed ones held. "
        "Contiguous spans: the same for a hand-out where each cache owns one contiguous span "
        "of samples",
    ),
    "index-reads": Study(
        "bench.studies.index_reads",
        ("--shard-mb", "8", "--sample-kb", "1024,100,10"),
        "one shard a sample size on a moto server, samples as webdataset writes them (two tar "
        "members a sample), GETs sent and bytes received counted. whole: one GET of the shard; "
        "headers: a ranged GET of each 512-byte tar header; windows: ranged GETs of 64 KiB from "
        "the first header not yet read. The model prices the counts at 20 ms to the first byte "
        "of a GET and 100 MB/s a stream; moto's own times are not kept",
    ),
}

TIMINGS = frozenset({"seconds"})  # measured times a study's script reports; never stored


def _untimed(figures: Any) -> Any:
    """``figures`` without the keys in ``TIMINGS``, at any depth."""
    if isinstance(figures, dict):
        return {k: _untimed(v) for k, v in figures.items() if k not in TIMINGS}
    if isinstance(figures, list):
        return [_untimed(v) for v in figures]
    return figures


def measure(name: str, argv: list[str] | None = None) -> dict[str, Any]:
    """Run study ``name`` (at the page's size, or with ``argv``): its stored record."""
    study = STUDIES[name]
    script = study.script()
    args = script.main_parser().parse_args(list(study.argv if argv is None else argv))
    started = time.time()
    figures = script.run(args)
    return {
        "what": study.what,
        "setup": vars(args),
        "measured": {"started": started, "load_avg": round(os.getloadavg()[0], 2)},
        "figures": _untimed(figures),
    }


def region(report: dict[str, Any], name: str) -> str:
    """The benchmarks page's region for study ``name``, from ``report['studies']``."""
    record = report.get("studies", {}).get(name)
    if record is None:
        return f"Not in `bench/results.json` yet: run `python -m bench.studies --only {name}`.\n"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(record["measured"]["started"]))
    table = STUDIES[name].script().table(record["figures"])
    return f"What was run: {record['what']}; computed on {when}.\n\n{table}\n"


def merged(report: dict[str, Any], fresh: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``report`` with the studies in ``fresh`` replaced (or added), in ``STUDIES``' order."""
    studies = report.get("studies", {}) | fresh
    return report | {"studies": {name: studies[name] for name in STUDIES if name in studies}}


def carried_over(results: Path, report: dict[str, Any]) -> dict[str, Any]:
    """``report``, a new run of the scenarios, with the studies kept in ``results`` (if any):
    a run of the harness measures no study, and must not drop them."""
    if not results.is_file():
        return report
    kept = json.loads(results.read_text()).get("studies")
    return report if not kept else merged(report, kept)
