"""The module table of the internals page (``docs/internals/design.md``) against the package:
every module of ``shardcache`` is named in it, every name in it is a module, and every module
says what it owns in a docstring of its own (the table's row is its summary for a reader)."""

from __future__ import annotations

import ast
import fnmatch
import re

from repo import ROOT

PACKAGE = ROOT / "shardcache"
PAGE = ROOT / "docs" / "internals" / "design.md"


def _modules() -> set[str]:
    """The public top-level modules and packages (``warm``, ``testing``) and the modules of the
    private subpackages, dotted (``_locking.flock``); ``__init__``/``__main__`` are the package
    itself, and a private subpackage is read through its modules."""
    names = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")}
    for package in (p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        if package.name.startswith("_"):
            names |= {
                f"{package.name}.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"
            }
        else:
            names.add(package.name)
    return names


def _table_names() -> list[str]:
    """The code spans of the first column of the page's first table."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| module |"))
    names = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def test_every_module_is_in_the_internals_table_and_every_entry_is_a_module() -> None:
    modules, names = _modules(), _table_names()
    covered = {m for m in modules if any(fnmatch.fnmatchcase(m, n) for n in names)}
    assert modules - covered == set(), f"modules missing from {PAGE.name}'s table"
    unknown = [n for n in names if not any(fnmatch.fnmatchcase(m, n) for m in modules)]
    assert unknown == [], f"names in {PAGE.name}'s table that are no module"


def test_every_module_has_a_docstring_saying_what_it_owns() -> None:
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc or len(doc.split()) < 4:
            missing.append(str(path.relative_to(ROOT)))
    assert missing == []


MODULE_LINES = 520  # "about 500": a module past it is doing more than one job


def test_no_module_is_much_over_500_lines() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines (split them by job): {long}"
