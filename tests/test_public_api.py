"""The public surface is exactly what the README documents, in both directions."""

from __future__ import annotations

import importlib
import pkgutil
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import shardcache

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    """The README text under the heading ``title`` up to the next heading of its level."""
    match = re.search(rf"^(#+) {re.escape(title)}\n(.*?)(?=^\1 |\Z)", README, re.M | re.S)
    assert match, f"README has no section {title!r}"
    return match.group(2)


def _documented() -> dict[str, set[str]]:
    """module -> names, from the README's "Public API" table; the exceptions of the
    ``shardcache`` row are the classes drawn in the "Errors" section's tree."""
    table: dict[str, set[str]] = {}
    for row in re.finditer(r"^\| `(shardcache[\w.]*)` \| (.*) \|$", _section("Public API"), re.M):
        table[row.group(1)] = set(re.findall(r"`(\w+)`", row.group(2)))
    tree = re.search(r"```\n(ShardCacheError\n.*?)```", _section("Errors"), re.S)
    assert tree, "the Errors section draws the exception tree"
    table["shardcache"] |= set(re.findall(r"^[\s│├└─]*(\w+Error|\w+Timeout)\b", tree[1], re.M))
    return table


def test_readme_documents_the_modules_that_are_public() -> None:
    public = {
        f"shardcache.{m.name}"
        for m in pkgutil.iter_modules(shardcache.__path__)
        if not m.name.startswith("_")
    }
    assert {"shardcache", *public} == set(_documented())


@pytest.mark.parametrize("module", sorted(_documented()))
def test_all_is_exactly_what_the_readme_documents(module: str) -> None:
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    documented = _documented()[module]
    assert exported - documented == set(), "exported but not in the README"
    assert documented - exported == set(), "in the README but not exported"
    for name in exported:
        assert getattr(mod, name) is not None


def test_public_names_belong_to_the_package() -> None:
    """Public classes say ``shardcache.X`` (tracebacks, reprs, pickles), not a private
    module; and they pickle by that name."""
    for name in shardcache.__all__:
        obj = getattr(shardcache, name)
        if isinstance(obj, type):
            assert obj.__module__ == "shardcache", name


def test_wheel_ships_the_license_the_typed_marker_and_no_tests(tmp_path: Path) -> None:
    """Built from a copy of the sources (a build leaves ``build/`` behind), without build
    isolation (no index needed): with this environment's setuptools, if recent enough."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (pyproject's build requirement)")
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "shardcache", src / "shardcache", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("shardcache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "shardcache/py.typed" in names
    assert f"shardcache-{shardcache.__version__}.dist-info/licenses/LICENSE" in names
    assert "shardcache/testing/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "devcheck/"))]
