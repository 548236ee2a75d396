"""No import cycles among the ``shardcache`` modules, and every import along the layers.

Read from the source (AST), not from ``sys.modules``, so every import counts: top-level ones,
lazy ones inside functions, and those under ``TYPE_CHECKING``. A cycle fails with its path,
e.g. ``shardcache._a -> shardcache._b -> shardcache._a``. The layers and their exceptions are
the tables of ``docs/internals/design.md`` (section "Layers"), read from there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from repo import ROOT as REPO

PACKAGE = "shardcache"
ROOT = REPO / PACKAGE
PAGE = REPO / "docs" / "internals" / "design.md"
ENTRY_POINTS = {PACKAGE, f"{PACKAGE}.__main__"}  # may import anything; nothing imports them


def _module_name(path: Path) -> str:
    parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <node.module> import ...`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The ``shardcache`` modules ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_package, node)
            # ``from . import _x`` imports the submodule ``_x``; ``from ._x import y`` imports
            # the module ``_x`` (``y`` is a name in it, or a submodule of a package ``_x``)
            names = [
                f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            # ``import shardcache._a.b`` depends on the innermost module that exists (which
            # runs its parents too; parents are not counted, so that a package's
            # ``__init__`` importing its own submodules makes no cycle)
            inner = name
            while inner and inner not in known:
                inner = inner.rpartition(".")[0]
            if inner and inner != module:
                found.add(inner)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan), each as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path_in(graph, component) for component in components]


def _path_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = _graph()
    assert len(graph) > 50
    assert "shardcache._base.errors" in graph["shardcache._config.settings"]  # top level, relative
    assert (
        "shardcache._observe.metric_records" in graph["shardcache._ops.report"]
    )  # lazy or not, read
    assert all(name.startswith(f"{PACKAGE}.") or name == PACKAGE for name in graph)


def test_the_cycle_finder_reports_a_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles among shardcache modules:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


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
    units = {_unit(module) for module in _graph()} - {None}
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
    violations, exceptions = _violations(_graph(), _layers()), _exceptions()
    assert violations - exceptions == set(), "imports against the layers (docs/internals/design.md)"
    assert exceptions - violations == set(), "exceptions listed that no import needs any more"
