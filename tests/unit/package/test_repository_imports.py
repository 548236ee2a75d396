"""No import cycle anywhere in the repository's Python packages (``shardcache``, ``bench``,
``tools``), lazy imports included; and the benchmarks' own order: shared support below the
scenarios, the scenarios below the harness, ``shardcache`` used through public names only."""

from __future__ import annotations

import ast

import import_graph

PACKAGES = ("shardcache", "bench", "tools")
# Scripts of their own that merge into the harness's report (B12 mounts JuiceFS).
HARNESS_USERS = {"bench.__main__", "bench.scenarios.b12_node_lock"}


def test_the_graph_reads_every_package_and_the_imports_across_them() -> None:
    graph = import_graph.graph(*PACKAGES)
    assert {name.partition(".")[0] for name in graph} == set(PACKAGES)
    assert "bench.scenarios.b13_epochs" in graph["bench.harness.registry"]
    assert "shardcache._datasets.interleave" in graph["bench.scenarios.b14_mixture"]
    assert "tools.juicefs" in graph["bench.scenarios.b12_node_lock"]
    assert "bench.harness.cli" in graph["bench.__main__"]


def test_the_cycle_finder_reports_a_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(import_graph.cycles(graph)) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_repository() -> None:
    cycles = import_graph.cycles(import_graph.graph(*PACKAGES))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_support_is_below_the_scenarios_and_the_scenarios_below_the_harness() -> None:
    graph = import_graph.graph("bench", "shardcache")
    upward = {
        (module, target)
        for module, imported in graph.items()
        for target in imported
        if (
            _under(module, "bench.support")
            and _under(target, "bench.scenarios", "bench.harness", "bench.studies")
        )
        or (
            _under(module, "bench.scenarios", "bench.studies")
            and _under(target, "bench.harness")
            and module not in HARNESS_USERS
        )
    }
    assert not upward, f"imports against bench's order: {sorted(upward)}"


def test_bench_imports_no_private_name_of_shardcache() -> None:
    private = []
    for module, path in import_graph.modules("bench").items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and _under(node.module or "", "shardcache"):
                private += [
                    f"{module}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                ]
    assert not private, "\n".join(private)
