"""A griffe extension for the API pages: the names ``shardcache`` exports but loads on first
use (its module ``__getattr__``: ``WebDataset``, ``ResumableDataset``, the WebDataset
stages, ...) become aliases in ``shardcache``, as an import would make them. Each page can
then say ``::: shardcache.WebDataset`` and is headed with the public name, not the private
module that defines it.

A lazy name's definition is looked for in the modules ``shardcache/__init__.py`` imports
from or names in a string (``"_datasets.resumable"``); a name found in none of them, or in
more than one, fails the build."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe

PACKAGE = "shardcache"


def _definitions(module: griffe.Module) -> Iterator[griffe.Object]:
    """Every class and function defined (not imported) at the top of ``module`` and of its
    submodules."""
    for member in module.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Module):
            yield from _definitions(member)
        elif isinstance(member, (griffe.Class, griffe.Function)):
            yield member


def _named_modules(init: Path) -> set[str]:
    """The modules (relative to the package, ``_datasets.wds``) that ``init`` imports from
    (``from ._datasets import wds`` names ``_datasets`` and ``_datasets.wds``) or names in a
    string constant."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            named.add(node.module)
            named.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named.add(node.value.lstrip("."))
    return named


class LazyNamesAsAliases(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != PACKAGE:
            return
        lazy = sorted({str(name) for name in pkg.exports or ()} - set(pkg.members))
        if not lazy:
            return
        assert isinstance(pkg.filepath, Path), pkg.filepath
        named = _named_modules(pkg.filepath)
        found: dict[str, list[griffe.Object]] = {name: [] for name in lazy}
        for obj in _definitions(pkg):
            module = obj.module.path.removeprefix(f"{PACKAGE}.")
            if obj.name in found and module in named:
                found[obj.name].append(obj)
        for name, objects in found.items():
            if len(objects) != 1:
                where = [obj.path for obj in objects] or "nowhere"
                raise griffe.GriffeError(
                    f"{PACKAGE}.__all__ lists {name!r}, not imported in {PACKAGE}/__init__.py; "
                    f"its definition was looked for in the modules __init__.py imports from or "
                    f"names and found {where}: import it there or make the definition unique"
                )
            pkg.set_member(name, griffe.Alias(name, objects[0], parent=pkg))
