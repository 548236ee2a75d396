"""The shape of the user-facing pages (README, home, install, quickstart, the how-to guides and
the reference): they say what to do, and leave the evidence to the pages that hold it. No test
file or test name, no benchmark id (B1..B16) and no measured figure: figures live on the
benchmarks page, generated from ``bench/results.json``, which the others link to."""

from __future__ import annotations

import re

import pytest
from doc_figures import figures, prose
from repo import ROOT

DOCS = ROOT / "docs"
USER_PAGES = sorted(
    [
        *(ROOT / "README.md", DOCS / "index.md", DOCS / "install.md", DOCS / "quickstart.md"),
        *(DOCS / "guides").glob("*.md"),
        *(DOCS / "reference").rglob("*.md"),
    ]
)

# A test file, a test's support module or a test function; the suite's folders may be named.
TEST_NAMES = re.compile(r"\btests/[\w/.-]+\.py\b|\btest_\w+|\w+\.py::\w+")
# "Backblaze B2" is a store, not a benchmark.
BENCHMARK_IDS = re.compile(r"(?<!Backblaze )\bB(?:1[0-6]|[1-9])\b")


def _page_id(path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", USER_PAGES, ids=_page_id)
def test_a_user_page_names_no_test(page) -> None:
    found = sorted(set(TEST_NAMES.findall(page.read_text())))
    assert not found, f"{_page_id(page)} names tests {found}: link docs/reliability.md instead"


@pytest.mark.parametrize("page", USER_PAGES, ids=_page_id)
def test_a_user_page_names_no_benchmark_id(page) -> None:
    found = sorted(set(BENCHMARK_IDS.findall(page.read_text())))
    assert not found, f"{_page_id(page)} names benchmarks {found}: link docs/benchmarks.md"


@pytest.mark.parametrize("page", USER_PAGES, ids=_page_id)
def test_a_user_page_copies_no_measured_figure(page) -> None:
    found = figures(prose(page.read_text()))
    assert not found, f"{_page_id(page)} holds figures {found}: link docs/benchmarks.md"


def test_printed_output_in_a_fenced_block_is_not_a_figure() -> None:
    page = (
        "Warm:\n\n```console\n$ shardcache warm\nwarmed 4 shards, 6.3 MB/s\n```\n\nat 420 MB/s.\n"
    )
    assert figures(prose(page)) == ["420 MB/s"]


def test_the_figure_rule_catches_figures_and_spares_settings() -> None:
    caught = "420 MB/s, 1.55 s/GB of client CPU, 18.9 us a sample, 93 samples/s, 11 min 37 s"
    assert figures(caught) == [
        "420 MB/s",
        "1.55 s/GB",
        "18.9 us a sample",
        "93 samples/s",
        "11 min 37 s",
    ]
    spared = "SHARDCACHE_MAX_BYTES=500G, parts of 16 MiB, 8 in flight, a 30 s timeout, B2 bucket"
    assert figures(spared) == []
