"""The public surface is exactly what the documentation (docs/reference/) lists, in both
directions."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import shutil
import subprocess
import sys
import typing
import zipfile
from pathlib import Path

import pytest
from repo import ROOT

import shardcache

API_PAGE = (ROOT / "docs" / "reference" / "api" / "index.md").read_text()
ERRORS_PAGE = (ROOT / "docs" / "reference" / "errors.md").read_text()


def _section(page: str, title: str) -> str:
    """The text of ``page`` under the heading ``title`` up to the next heading of its level."""
    match = re.search(rf"^(#+) {re.escape(title)}\n(.*?)(?=^\1 |\Z)", page, re.M | re.S)
    assert match, f"no section {title!r}"
    return match.group(2)


def _documented() -> dict[str, set[str]]:
    """module -> names, from the "Public API" table of docs/reference/api/index.md; the
    exceptions of the ``shardcache`` row are the classes drawn in docs/reference/errors.md."""
    table: dict[str, set[str]] = {}
    for row in re.finditer(
        r"^\| `(shardcache[\w.]*)` \| (.*) \|$", _section(API_PAGE, "Public API"), re.M
    ):
        table[row.group(1)] = set(re.findall(r"`(\w+)`", row.group(2)))
    tree = re.search(r"```\n(ShardCacheError\n.*?)```", ERRORS_PAGE, re.S)
    assert tree, "docs/reference/errors.md draws the exception tree"
    table["shardcache"] |= set(re.findall(r"^[\s│├└─]*(\w+Error|\w+Timeout)\b", tree[1], re.M))
    return table


def test_docs_list_the_modules_that_are_public() -> None:
    public = {
        f"shardcache.{m.name}"
        for m in pkgutil.iter_modules(shardcache.__path__)
        if not m.name.startswith("_")
    }
    assert {"shardcache", *public} == set(_documented())


@pytest.mark.parametrize("module", sorted(_documented()))
def test_all_is_exactly_what_the_docs_list(module: str) -> None:
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    documented = _documented()[module]
    assert exported - documented == set(), "exported but not in the docs"
    assert documented - exported == set(), "in the docs but not exported"
    for name in exported:
        assert getattr(mod, name) is not None


def test_public_names_belong_to_the_package() -> None:
    """Public classes say ``shardcache.X`` (tracebacks, reprs, pickles), not a private
    module; and they pickle by that name."""
    for name in shardcache.__all__:
        obj = getattr(shardcache, name)
        if isinstance(obj, type):
            assert obj.__module__ == "shardcache", name


def _classes(annotation: object) -> typing.Iterator[type]:
    if isinstance(annotation, type):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _classes(arg)


def test_what_the_cache_returns_is_exported(tmp_path: Path) -> None:
    """Every class a public ``ShardCache`` method returns can be imported from
    ``shardcache`` (to annotate, to isinstance), as ``evict``'s ``EvictReport`` and
    ``entries``' ``CacheEntry``."""
    exported = {getattr(shardcache, name) for name in shardcache.__all__}
    for name, method in inspect.getmembers(shardcache.ShardCache, inspect.isfunction):
        if not name.startswith("_"):
            returned = typing.get_type_hints(method).get("return")
            for cls in _classes(returned):
                assert cls in exported or cls.__module__ in ("builtins", "pathlib", "typing"), (
                    f"ShardCache.{name} returns {cls.__module__}.{cls.__qualname__}, not exported"
                )
    report = shardcache.ShardCache(tmp_path).evict(0)
    assert isinstance(report, shardcache.EvictReport)
    assert type(report).__module__ == "shardcache"


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
    assert not [n for n in names if n.startswith(("tests/", "bench/", "tools/"))]


def test_api_pages_render_every_public_name() -> None:
    """The generated API pages (mkdocstrings ``::: name`` lines) cover the whole surface."""
    pages = (ROOT / "docs" / "reference" / "api").glob("*.md")
    rendered = {m for page in pages for m in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M)}
    missing = [
        name
        for name in shardcache.__all__
        if not any(path.rsplit(".", 1)[-1] == name for path in rendered)
    ]
    assert not missing, f"no ::: line in docs/reference/api/ for {missing}"
    for module in ("shardcache.distributed", "shardcache.warm", "shardcache.testing"):
        assert module in rendered
