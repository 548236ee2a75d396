"""Every import of a ``shardcache`` module along the layers (cycles: test_repository_imports).

The imports are read from the source (tests/support/import_graph.py), lazy ones included. The
layers and their exceptions are the tables of ``docs/internals/design.md`` (section
"Layers"), read from there.
"""

from __future__ import annotations

import re

import import_graph
from repo import ROOT as REPO

PACKAGE = "shardcache"
PAGE = REPO / "docs" / "internals" / "design.md"
ENTRY_POINTS = {PACKAGE, f"{PACKAGE}.__main__"}  # may import anything; nothing imports them


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph.graph(PACKAGE)
    assert len(graph) > 50
    assert "shardcache._base.errors" in graph["shardcache._config.settings"]  # top level, relative
    assert (
        "shardcache._observe.metric_records" in graph["shardcache._ops.report"]
    )  # lazy or not, read
    assert all(name.startswith(f"{PACKAGE}.") or name == PACKAGE for name in graph)


def _table(header: str) -> list[list[str]]:
    """The rows of the page's table whose header starts with ``header``, as cells."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _layers() -> dict[str, int]:
    """Each unit (a private subpackage, a public module or package) and its layer."""
    return {
        unit: int(row[0])
        for row in _table("| layer | unit |")
        for unit in re.findall(r"`([^`]+)`", row[1])
    }


def _exceptions() -> set[tuple[str, str]]:
    """The imports against the rule the page lists, each with its reason."""
    found = set()
    for importer, imported, why in _table("| importer | imports |"):
        assert why, f"the exception {importer} -> {imported} gives no reason"
        found.add((f"{PACKAGE}.{importer.strip('`')}", imported.strip("`")))
    return {(a, b if b == PACKAGE else f"{PACKAGE}.{b}") for a, b in found}


def _unit(module: str) -> str | None:
    """The unit a module belongs to (``shardcache._locking.flock`` -> ``_locking``)."""
    return None if module in ENTRY_POINTS else module.split(".")[1]


def _violations(graph: dict[str, set[str]], layers: dict[str, int]) -> set[tuple[str, str]]:
    """The imports from a module to another unit that is not on a lower layer."""
    found = set()
    for module, imported in graph.items():
        for target in imported:
            unit, other = _unit(module), _unit(target)
            if unit is None or unit == other:
                continue
            if other is None or layers[other] >= layers[unit]:
                found.add((module, target))
    return found


def test_every_unit_is_on_a_layer() -> None:
    units = {_unit(module) for module in import_graph.graph(PACKAGE)} - {None}
    layers = _layers()
    assert units == set(layers), "units on no layer, or layers naming no unit"


def test_the_rule_keeps_the_independences_it_promises() -> None:
    layers = _layers()
    assert layers["_locking"] == layers["_transfer"]  # neither imports the other
    assert layers["_prefetch"] < layers["_cache"]  # the cache uses the prefetcher, not back
    assert layers["_base"] == min(layers.values())


def test_the_layer_check_finds_an_upward_import() -> None:
    layers = {"_low": 0, "_high": 1, "_side": 1}
    graph = {
        "shardcache._low.a": {"shardcache._high.b"},
        "shardcache._high.b": {"shardcache._low.a", "shardcache._high.c"},
        "shardcache._high.c": {"shardcache._side.d"},
        "shardcache._side.d": {"shardcache"},
        "shardcache": {"shardcache._high.b"},
    }
    assert _violations(graph, layers) == {
        ("shardcache._low.a", "shardcache._high.b"),
        ("shardcache._high.c", "shardcache._side.d"),
        ("shardcache._side.d", "shardcache"),
    }


def test_every_import_follows_the_layers() -> None:
    violations, exceptions = _violations(import_graph.graph(PACKAGE), _layers()), _exceptions()
    assert violations - exceptions == set(), "imports against the layers (docs/internals/design.md)"
    assert exceptions - violations == set(), "exceptions listed that no import needs any more"
