"""The benchmarks page against ``bench/results.json``: its tables are generated from the file
(``python -m bench.docs_tables``), so every figure on it is one the harness measured."""

from __future__ import annotations

import json
import re

from doc_figures import figures
from repo import ROOT

from bench import docs_tables, studies

PAGE = ROOT / "docs" / "benchmarks.md"


def _report() -> dict:
    return json.loads((ROOT / "bench" / "results.json").read_text())


def test_the_pages_tables_are_what_results_json_gives() -> None:
    stale = docs_tables.differences(PAGE.read_text(), _report())
    assert not stale, (
        f"regions {stale} differ from bench/results.json: run python -m bench.docs_tables"
    )


def test_every_scenario_in_the_results_has_a_heading_and_a_generated_table() -> None:
    page = PAGE.read_text()
    regions = {m[2] for m in docs_tables.REGION.finditer(page)}
    assert {"run", "summary"} <= regions
    for sid in _report()["results"]:
        assert sid in regions, f"no <!-- generated: {sid} --> region on the page"
        heading = f"## {sid}: {docs_tables.SCENARIOS[sid]['title']}"
        assert heading in page.splitlines(), f"the summary links to a missing heading {heading!r}"


def test_a_figure_edited_by_hand_is_caught() -> None:
    page, report = PAGE.read_text(), _report()
    b2 = next(m for m in docs_tables.REGION.finditer(page) if m[2] == "B2")
    shardcache_row = next(line for line in b2[3].splitlines() if line.startswith("| **"))
    edited_row = re.sub(r"\| (\d+) \|", lambda m: f"| {int(m[1]) + 1} |", shardcache_row, count=1)
    assert edited_row != shardcache_row
    assert docs_tables.differences(page.replace(shardcache_row, edited_row), report) == ["B2"]
    # and a figure in the results file that the page does not show yet
    report["results"]["B9"]["shardcache"]["first_sample_s"] += 1
    assert docs_tables.differences(page, report) == ["summary", "B9"]


def test_a_merged_scenario_says_when_it_was_measured() -> None:
    report = _report()
    report["results"]["B14"]["measured"] = {"started": 1795900000.0, "load_avg": 0.4}
    assert "B14 (measured alone on 2026-11-28 " in docs_tables.run_region(report)
    assert "load average 0.4." in docs_tables.scenario_region(report, "B14")


def test_no_figure_is_typed_outside_the_generated_tables() -> None:
    prose = docs_tables.REGION.sub("", PAGE.read_text())
    assert not figures(prose), figures(prose)


def test_every_study_has_its_generated_table_and_stores_no_timing() -> None:
    page, report = PAGE.read_text(), _report()
    regions = {m[2] for m in docs_tables.REGION.finditer(page)}
    assert set(studies.STUDIES) <= regions, set(studies.STUDIES) - regions
    assert list(report["studies"]) == list(studies.STUDIES), "run: python -m bench.studies"
    for name, region in ((m[2], m[3]) for m in docs_tables.REGION.finditer(page)):
        if name in studies.STUDIES:
            assert "What was run:" in region and "|---" in region, name

    def keys(value: object) -> set[str]:
        if isinstance(value, dict):
            return set(value) | {k for v in value.values() for k in keys(v)}
        return {k for v in value for k in keys(v)} if isinstance(value, list) else set()

    assert not keys(report["studies"]) & studies.TIMINGS
    assert "| moto s |" not in docs_tables.region(report, "index-reads")


def test_a_study_figure_edited_by_hand_is_caught() -> None:
    page, report = PAGE.read_text(), _report()
    moves = next(m for m in docs_tables.REGION.finditer(page) if m[2] == "elastic-moves")
    row = next(line for line in moves[3].splitlines() if line.startswith("| 2,000 |"))
    edited = page.replace(row, row.replace("| 2,000 |", "| 2,001 |", 1))
    assert docs_tables.differences(edited, report) == ["elastic-moves"]
    quality = report["studies"]["shuffle-quality"]["figures"]["results"]
    next(iter(quality.values()))["entropy_bits"] += 1
    assert docs_tables.differences(page, report) == ["shuffle-quality"]


def test_merging_a_study_keeps_the_others_and_a_harness_run_keeps_them_all(tmp_path) -> None:
    report = _report()
    fresh = {"elastic-moves": {"what": "re-run", "figures": []}}
    merged = studies.merged(report, fresh)
    assert merged["results"] == report["results"]
    assert list(merged["studies"]) == list(studies.STUDIES)
    assert merged["studies"]["elastic-moves"] == fresh["elastic-moves"]
    assert merged["studies"]["index-reads"] == report["studies"]["index-reads"]
    # a new run of the scenarios (python -m bench without --merge) measures no study
    results = tmp_path / "results.json"
    results.write_text(json.dumps(report))
    run = {k: v for k, v in report.items() if k != "studies"}
    assert studies.carried_over(results, run)["studies"] == report["studies"]
    assert studies.carried_over(tmp_path / "absent.json", run) == run


def test_b14_judges_the_with_workers_aim_on_its_own() -> None:
    """The benchmarks page cannot read as if the with-workers aim (<= 1 %) were met when
    the stored run missed it: its verdict follows the stored figure, and so does B14's."""
    report = _report()
    b14 = report["results"]["B14"]
    pct = b14["workers"]["workers_mixing_cpu_pct"]
    assert b14["verdicts"]["workers"] == ("met" if pct <= 1.0 else "MISSED"), b14
    assert b14["verdict"] == ("met" if "MISSED" not in b14["verdicts"].values() else "MISSED")
    region = docs_tables.scenario_region(report, "B14")
    assert f"(aim <= 1 %: **{b14['verdicts']['workers']}**)" in region, region
    assert f"Verdict: **{b14['verdict']}**." in region
