"""The benchmarks page's tables, generated from ``bench/results.json``.

    python -m bench.docs_tables            # rewrite the generated regions of docs/benchmarks.md
    python -m bench.docs_tables --check    # exit 1 and name every region that differs

A region is the text between ``<!-- generated: ID -->`` and ``<!-- end generated -->``; ``ID``
is ``run`` (when and where the figures were measured), ``summary`` (one row per scenario), a
scenario id (``B2``: its readers, their figures, target and verdict) or a study's name
(``shuffle-quality``: see ``bench.studies``). Nothing here measures:
every figure on the page comes from the results file, so the page cannot drift from it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from bench import studies

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.json"
PAGE = ROOT / "docs" / "benchmarks.md"
REGION = re.compile(r"(<!-- generated: (\S+) -->\n)(.*?)(<!-- end generated -->)", re.DOTALL)

# Per scenario: the section it links to, a short title, the figure the summary shows, and the
# columns of its own table (key in the results, header). A missing key leaves its cell empty.
# A scenario's results may name shardcache's row themselves ("label"), else "label" here does.
SCENARIOS: dict[str, dict[str, Any]] = {
    "B1": {
        "label": "shardcache drop-in",
        "ratio": "throughput against WebDataset",
        "title": "warm cache, full WebDataset pipeline",
        "headline": ("mb_s", "MB/s"),
        "columns": [("mb_s", "MB/s"), ("wall_s", "wall s")],
    },
    "B2": {
        "label": "shardcache threads=8",
        "ratio": "samples/s against the best peer",
        "title": "cold cache over a shaped link, equal concurrency",
        "headline": ("samples_s", "samples/s"),
        "columns": [("samples_s", "samples/s"), ("mb_s", "MB/s"), ("wall_s", "wall s")],
    },
    "B3": {
        "label": "shardcache x8",
        "ratio": "wall time against one process",
        "title": "8 processes on one node share one cache",
        "headline": ("wall_s", "s"),
        "columns": [("wall_s", "wall s"), ("mb_s", "MB/s"), ("gets_per_shard_max", "GETs a shard")],
    },
    "B4": {
        "label": "shardcache",
        "ratio": "hit against os.stat + open",
        "title": "per-call overhead",
        "headline": ("hit_us", "us a hit"),
        "columns": [("hit_us", "hit us"), ("lock_us", "lock us"), ("us", "us")],
    },
    "B5": {
        "label": "shardcache",
        "ratio": None,
        "title": "memory of a large download",
        "headline": ("single_rss_growth_mib", "MiB RSS growth"),
        "columns": [
            ("single_rss_growth_mib", "1 GiB stream: RSS MiB"),
            ("parallel_rss_growth_mib", "96 MiB in parts: RSS MiB"),
        ],
    },
    "B6": {
        "label": "shardcache (fast server)",
        "ratio": "against s3fs get",
        "title": "one large object in ranged parts",
        "headline": ("mb_s", "MB/s"),
        "columns": [("mb_s", "MB/s"), ("wall_s", "wall s"), ("cpu_s_per_gb", "client CPU s/GB")],
    },
    "B7": {
        "label": "shardcache threads=4",
        "ratio": None,
        "title": "latency hidden from a consumer",
        "headline": ("wait_pct", "% of wall waiting"),
        "columns": [
            ("wait_pct", "waiting, % of wall"),
            ("first_sample_s", "first sample s"),
            ("wall_s", "wall s"),
        ],
    },
    "B8": {
        "label": "shardcache fetch",
        "ratio": "CPU a GB against s3fs get",
        "title": "client CPU per GB of a cold download",
        "headline": ("cpu_s_per_gb", "s/GB"),
        "columns": [
            ("cpu_s_per_gb", "CPU s/GB"),
            ("fast_server_cpu_s_per_gb", "fast server: CPU s/GB"),
            ("wall_s", "wall s"),
        ],
    },
    "B9": {
        "label": "shardcache drop-in",
        "ratio": "against WebDataset streaming",
        "title": "time to the first sample, cold",
        "headline": ("first_sample_s", "s"),
        "columns": [("first_sample_s", "first sample s")],
    },
    "B10": {
        "label": "shardcache resume warm",
        "ratio": "the rest's rate against the uninterrupted epoch's",
        "title": "resume at 90 % of an epoch of 1M samples",
        "headline": ("first_batch_s", "s to the first batch"),
        "columns": [
            ("first_batch_s", "first batch s"),
            ("finish_s", "rest s"),
            ("samples_s", "samples/s"),
            ("epoch_s", "epoch s"),
            ("last_10pct_s", "last 10 % s"),
            ("to_resume_point_s", "to the resume point s"),
            ("gets", "GETs"),
        ],
    },
    "B11": {
        "label": "shardcache",
        "ratio": "miss at 100k against 1k",
        "title": "bookkeeping against the shards cached",
        "headline": ("miss_ms_100k", "ms a miss at 100k"),
        "columns": [
            ("miss_ms_1k", "miss ms, 1k"),
            ("miss_ms_10k", "10k"),
            ("miss_ms_100k", "100k"),
            ("hit_ms_100k", "hit ms, 100k"),
            ("status_s", "status s"),
            ("verify_quick_s", "verify s"),
            ("evict_s", "evict s"),
        ],
    },
    "B12": {
        "label": "with the node lock",
        "ratio": "FUSE operations, with / without the node lock",
        "title": "the node lock on a network file system",
        "headline": ("fuse_ops_per_shard", "FUSE ops a shard"),
        "merge": "python -m bench.scenarios.b12_node_lock --merge",
        "columns": [
            ("fuse_ops_per_shard", "FUSE ops a shard"),
            ("meta_ops_per_shard", "metadata ops a shard"),
            ("misses", "downloads"),
            ("seconds", "wall s"),
        ],
    },
    "B13": {
        "label": "shardcache, index made ahead (rank scope)",
        "ratio": None,
        "title": "requests and bytes per epoch",
        "headline": ("gets_total", "GETs in 3 epochs"),
        "columns": [
            ("gets", "GETs, epochs 0 / 1 / 2"),
            ("mb", "MB, epochs 0 / 1 / 2"),
            ("order_changed", "order changed"),
            ("same_rank_pct", "same rank %"),
        ],
    },
    "B14": {
        "label": "MixtureDataset, 3 sources",
        "ratio": "samples/s, mixture / one source",
        "title": "the cost of mixing",
        "headline": ("cpu_us_per_sample", "us CPU a sample"),
        "columns": [
            ("samples_s", "samples/s"),
            ("cpu_us_per_sample", "CPU us a sample"),
            ("wall_s", "wall s"),
        ],
    },
    "B15": {
        "label": "shardcache, verification on",
        "ratio": "MB/s against the best peer",
        "title": "cold throughput against a fast server",
        "headline": ("mb_s", "MB/s"),
        "columns": [
            ("mb_s", "MB/s"),
            ("mb_s_runs", "MB/s, each run"),
            ("cpu_s_per_gb", "client CPU s/GB"),
            ("server_cpu_s_per_gb", "server s/GB"),
        ],
    },
    "B16": {
        "label": "stage() + webdataset's tar reader",
        "ratio": "CPU a sample, stage() / webdataset, the first case",
        "title": "the cost of stage()'s format check",
        "headline": ("cpu_us_per_sample", "us CPU a sample"),
        "columns": [
            ("cpu_us_per_sample", "CPU us a sample"),
            ("samples_s", "samples/s"),
            ("wall_s", "wall s"),
        ],
    },
}

# Figures beside the ratio that a scenario's verdict rests on, with what they mean.
DERIVED = {
    "link_fraction": "share of the link's capacity",
    "best_peer": "best peer",
    "lock_ratio": "lock / bare filelock",
    "gets_exactly_one_per_shard": "exactly one GET a shard",
    "limit_mb_s": "limit, MB/s",
    "fast_server_ratio": "fast server: against s3fs get",
    "s3torchconnector_ratio": "against s3torchconnector",
    "fast_server_s3torchconnector_ratio": "fast server: against s3torchconnector",
    "speedup_vs_naive": "faster than the naive skip",
    "cold_ratio": "cold resume's rate against uninterrupted",
    "resume_overhead_warm_s": "warm resume's extra seconds",
    "resume_overhead_cold_s": "cold resume's extra seconds",
    "hit_ratio": "hit at 100k against 1k",
    "cpu_ratio": "CPU a sample, one source / mixture",
    "mixing_cpu_us_per_sample": "mixing's CPU, us a sample",
    "order_cpu_us_per_sample": "computing the order, us a sample",
    "curl_ratio": "against curl",
}
DERIVED_BY_SCENARIO = {"B15": {"cpu_ratio": "client CPU a GB against the best peer's"}}

KIND_RATIOS = {
    "mb_s_vs_boto3": "MB/s, against boto3",
    "mb_s_vs_boto3_md5": "MB/s, against boto3 + MD5 pass",
    "cpu_vs_boto3": "CPU, against boto3",
    "cpu_vs_boto3_md5": "CPU, against boto3 + MD5 pass",
}


def number(value: Any) -> str:
    """A figure as the page prints it: thousands separated, no spurious digits."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(number(v) for v in value)
    if not isinstance(value, int | float):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:,.1f}".rstrip("0").rstrip(".")
    return f"{value:g}"


def anchor(sid: str) -> str:
    """The id the docs' Markdown gives the heading ``## B2: <title>`` (its toc slug)."""
    text = re.sub(r"[^\w\s-]", "", f"{sid}: {SCENARIOS[sid]['title']}").strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _when(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))


def _measured(run: dict[str, Any]) -> str:
    """When a scenario merged into the full run's file (``--merge``) was measured."""
    return f"measured alone on {_when(run['started'])}, load average {number(run['load_avg'])}"


def run_region(report: dict[str, Any]) -> str:
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    merged = [sid for sid, res in report["results"].items() if res.get("measured")]
    lines = [
        f"- **Full run**: `scripts/bench` (size `{report['size']}`) on "
        f"{_when(report['started'])}, {report['duration_s'] / 60:.0f} min.",
        f"- **Machine**: {m['cores']} cores ({m['cpu']}), {m['mem_gib']} GiB, Linux {m['kernel']}.",
        f"- **Link**: {report['link']}.",
        f"- **moto's own ceiling**, unshaped: {number(report['server_ceiling']['mb_s'])} MB/s.",
        f"- **Versions**: {versions}.",
    ]
    if merged:
        lines.append(
            "- **Measured alone since** and merged (`--merge`): "
            + ", ".join(
                f"{sid} ({_measured(report['results'][sid]['measured'])})" for sid in merged
            )
            + "."
        )
    return "\n".join(lines) + "\n"


def _headline(sid: str, res: dict[str, Any]) -> str:
    key, unit = SCENARIOS[sid]["headline"]
    value = res.get("shardcache", {}).get(key)
    return "-" if value is None else f"{number(value)} {unit}"


def summary_region(report: dict[str, Any]) -> str:
    lines = [
        "| id | what it measures | shardcache | ratio | verdict |",
        "|---|---|---:|---:|---|",
    ]
    for sid, res in report["results"].items():
        spec = SCENARIOS.get(sid)
        if spec is None:
            continue
        title = f"[{spec['title']}](#{anchor(sid)})"
        if "error" in res:
            lines.append(f"| {sid} | {title} | error | | not run |")
            continue
        ratio = "-" if res.get("ratio") is None else number(res["ratio"])
        verdict = res["verdict"]
        lines.append(f"| {sid} | {title} | {_headline(sid, res)} | {ratio} | {verdict} |")
    return "\n".join(lines) + "\n"


def _row(name: str, fig: dict[str, Any], columns: list[tuple[str, str]]) -> str:
    if "status" in fig or "error" in fig:
        text = _cell(str(fig.get("status") or f"error: {fig['error']}"))
        return f"| {name} | {text} |" + " |" * (len(columns) - 1)
    cells = [number(fig[k]) if k in fig else "" for k, _ in columns]
    return f"| {name} | " + " | ".join(cells) + " |"


def _table(res: dict[str, Any], label: str, columns: list[tuple[str, str]]) -> list[str]:
    readers = {f"**{label}**": res["shardcache"]} | {
        _cell(name): fig for name, fig in res.get("peers", {}).items()
    }
    used = [c for c in columns if any(c[0] in fig for fig in readers.values())]
    lines = [
        "| reader | " + " | ".join(header for _, header in used) + " |",
        "|---|" + "---:|" * len(used),
    ]
    lines += [_row(name, fig, used) for name, fig in readers.items()]
    return lines


def _b16_cases(res: dict[str, Any]) -> list[str]:
    lines = ["", "| case | CPU a sample, stage() / webdataset | stage()'s extra CPU, us a sample |"]
    lines += ["|---|---:|---:|"]
    for case, ratio in res["cpu_ratios"].items():
        lines.append(f"| {_cell(case)} | {number(ratio)} | {number(res['extra_cpu_us'][case])} |")
    return lines


def _b14_workers(res: dict[str, Any]) -> list[str]:
    workers = res["workers"]
    lines = ["", f"With DataLoader workers: {_cell(workers['what'])}.", ""]
    lines += ["| reader | CPU us a sample |", "|---|---:|"]
    lines += [f"| {_cell(n)} | {number(v)} |" for n, v in workers["cpu_us_per_sample"].items()]
    lines += [
        "",
        f"- what the workers' own orders cost: {number(workers['workers_order_cpu_pct'])} %",
        f"- the prepared mixture against one source: {number(workers['workers_mixing_cpu_pct'])} %"
        + _aim(res.get("verdicts", {}).get("workers")),
    ]
    if workers.get("workers_mixing_cpu_pct_runs"):
        each = number(workers["workers_mixing_cpu_pct_runs"])
        lines.append(f"- the same, each epoch against the one source's of its pair: {each} %")
    return lines


def _aim(verdict: str | None) -> str:
    """The with-workers aim's own verdict (<= 1 %), for a run that judged it."""
    return "" if verdict is None else f" (aim <= 1 %: **{verdict}**)"


CEILINGS = {
    "server_ranged_ceiling": "the fast server",
    "moto_ranged_ceiling": "moto",
    "seaweedfs_ranged_ceiling": "SeaweedFS",
}


def _b6_kinds(res: dict[str, Any]) -> list[str]:
    ceilings = [f"{name} {number(res[k]['mb_s'])}" for k, name in CEILINGS.items() if k in res]
    lines = (
        [
            "",
            "Each server's own ceiling for these ranged GETs, unshaped, MB/s: "
            + ", ".join(ceilings)
            + ".",
        ]
        if ceilings
        else []
    )
    fractions = res.get("link_fractions") or {}
    if fractions:
        lines += ["", "Share of the link's capacity, by server:", ""]
        lines += ["| server | reader | share |", "|---|---|---:|"]
        for server, readers in fractions.items():
            lines += [f"| {_cell(server)} | {_cell(n)} | {number(f)} |" for n, f in readers.items()]
    for how, label in (("", "through the link"), ("_unshaped", "unshaped")):
        kinds = res.get(f"kind_ratios{how}")
        if not kinds:
            continue
        lines += ["", f"Four kinds of object on SeaweedFS, {label}:", ""]
        names = [n for n in KIND_RATIOS if any(n in ratios for ratios in kinds.values())]
        lines += ["| kind | " + " | ".join(KIND_RATIOS[n] for n in names) + " |"]
        lines += ["|---|" + "---:|" * len(names)]
        for kind, ratios in kinds.items():
            cells = [number(ratios[n]) if n in ratios else "" for n in names]
            lines.append(f"| {_cell(kind)} | " + " | ".join(cells) + " |")
    return lines


def scenario_region(report: dict[str, Any], sid: str) -> str:
    res = report["results"].get(sid)
    if res is None:
        merge = SCENARIOS[sid].get("merge", f"python -m bench --only {sid} --merge")
        return f"Not in `bench/results.json` yet: run `{merge}`.\n"
    if "error" in res:
        return f"Not measured: the run failed ({_cell(res['error'])}).\n"
    when = f"; {_measured(res['measured'])}" if res.get("measured") else ""
    lines = [f"What was run: {_cell(res['what'])}{when}.", ""]
    spec = SCENARIOS[sid]
    lines += _table(res, res.get("label", spec["label"]), spec["columns"])
    names = DERIVED | DERIVED_BY_SCENARIO.get(sid, {})
    derived = [f"- {names[k]}: {number(res[k])}" for k in names if res.get(k) is not None]
    ratio = []
    if res.get("ratio") is not None:
        meaning = spec["ratio"] or "shardcache against the first peer"
        ratio = [f"- ratio, {meaning}: {number(res['ratio'])}"]
    if ratio or derived:
        lines += ["", *ratio, *derived]
    if sid == "B6":
        lines += _b6_kinds(res)
    if sid == "B14" and res.get("workers"):
        lines += _b14_workers(res)
    if sid == "B16":
        lines += _b16_cases(res)
    errors = res.get("row_errors") or {}
    lines += [f"- **error** in {_cell(n)}: {_cell(str(e))}" for n, e in errors.items()]
    lines += ["", f"Target: {_cell(res['target'])}. Verdict: **{res['verdict']}**."]
    return "\n".join(lines) + "\n"


def region(report: dict[str, Any], rid: str) -> str:
    if rid == "run":
        return run_region(report)
    if rid == "summary":
        return summary_region(report)
    if rid in SCENARIOS:
        return scenario_region(report, rid)
    if rid in studies.STUDIES:
        return studies.region(report, rid)
    raise KeyError(
        f"no generated region {rid!r}: use run, summary or one of "
        f"{', '.join([*SCENARIOS, *studies.STUDIES])}"
    )


def render(page: str, report: dict[str, Any]) -> str:
    """The page with every generated region rewritten from the report."""
    return REGION.sub(lambda m: m[1] + "\n" + region(report, m[2]) + "\n" + m[4], page)


def differences(page: str, report: dict[str, Any]) -> list[str]:
    """The regions whose text differs from what the report gives (empty when they agree)."""
    return [m[2] for m in REGION.finditer(page) if m[3] != "\n" + region(report, m[2]) + "\n"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only report regions that differ")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    report = json.loads(args.results.read_text())
    page = args.page.read_text()
    if args.check:
        stale = differences(page, report)
        for rid in stale:
            print(f"{args.page}: region {rid} differs from {args.results}", file=sys.stderr)
        if stale:
            print("run: python -m bench.docs_tables", file=sys.stderr)
        return 1 if stale else 0
    args.page.write_text(render(page, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
