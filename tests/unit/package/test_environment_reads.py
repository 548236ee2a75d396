"""Only ``_config`` reads the environment (and ``testing``, whose servers inherit a copy of
it): every other module is given values. The rule is docs/internals/design.md's "Layers"."""

from __future__ import annotations

import ast
from pathlib import Path

import shardcache

PACKAGE = Path(shardcache.__file__).parent
READERS = {"_config", "testing"}  # subpackages allowed to read os.environ
_OS_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_reads(source: str) -> list[int]:
    """The lines of ``source`` that touch the process environment through ``os``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in _OS_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ) or (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(alias.name in _OS_NAMES for alias in node.names)
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_checker_sees_each_form_of_reading() -> None:
    source = (
        "import os\nfrom os import environ\n"
        "a = os.environ['X']\nb = os.getenv('Y')\nc = dict(os.environ)\nd = os.getpid()\n"
    )
    assert environment_reads(source) == [2, 3, 4, 5]


def test_only_the_settings_read_the_environment() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in READERS:
            continue
        found += [f"{relative}:{line}" for line in environment_reads(path.read_text())]
    assert not found, (
        "the environment is read outside _config (give the module the value, and read the "
        f"variable in _config: a setting, _config.launcher or _config.borrowed): {found}"
    )
