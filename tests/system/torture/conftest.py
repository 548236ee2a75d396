"""Torture suite: one knob, ``SHARDCACHE_TORTURE=full`` (set by ``scripts/torture``).

Without it every test runs a reduced but real version (CI). Each test records what it
tried and what happened through the ``figures`` fixture; the session prints them as a
table and, when ``SHARDCACHE_TORTURE_RESULTS`` names a file, writes them there as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from torture_scale import FULL

_ROWS: list[dict[str, Any]] = []


class Figures:
    """Rows of the Reliability table: area, what was tried, how many times, outcome."""

    def __init__(self, test: str) -> None:
        self.test = test

    def add(self, area: str, tried: str, times: int, outcome: str, **extra: Any) -> None:
        _ROWS.append(
            {
                "test": self.test,
                "area": area,
                "tried": tried,
                "times": times,
                "outcome": outcome,
                "mode": "full" if FULL else "ci",
                **extra,
            }
        )


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    yield Figures(request.node.nodeid)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.torture)


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| Area | What was tried | Times | Outcome |", "|---|---|---:|---|"]
    lines += [f"| {r['area']} | {r['tried']} | {r['times']} | {r['outcome']} |" for r in rows]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ROWS:
        return
    terminalreporter.section(f"torture figures ({'full' if FULL else 'ci'} size)")
    terminalreporter.write_line(format_table(_ROWS))
    target = os.environ.get("SHARDCACHE_TORTURE_RESULTS")
    if target:
        Path(target).write_text(json.dumps(_ROWS, indent=1) + "\n")
        terminalreporter.write_line(f"figures written to {target}")
