"""The import graph of the repository's Python packages, read from their source (AST), and
the cycles in it.

Read from the source, not from ``sys.modules``, so every import counts: top-level ones, lazy
ones inside functions, and those under ``TYPE_CHECKING``. A module's edges go to the modules
of the packages read (``graph("shardcache", "bench")``); imports of anything else are left
out. A cycle is reported as a path, e.g. ``shardcache._a -> shardcache._b -> shardcache._a``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from repo import ROOT


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(*packages: str) -> dict[str, Path]:
    """Every module of the top-level ``packages`` (their ``.py`` files), by dotted name."""
    return {
        _module_name(path): path
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <node.module> import ...`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, node.module] if node.module else base)


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules in ``known`` that ``module`` imports anywhere in its source."""
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


def graph(*packages: str) -> dict[str, set[str]]:
    """Each module of ``packages`` and the modules of ``packages`` it imports."""
    found = modules(*packages)
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
    return [path_in(graph, component) for component in components]


def path_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
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
