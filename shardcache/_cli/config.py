"""``shardcache config``: every setting, its value and where it came from (``--json``:
with the value as its variable takes it); a bad value is shown under its setting and
makes the exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .._config.display import format_setting
from .._config.settings import Settings
from . import common


def add(commands: Any) -> None:
    config = commands.add_parser(
        "config",
        help="print the resolved settings and where each came from",
        description="Print every setting, its value and its source: argument, SHARDCACHE_* "
        "variable, launcher variable (torchrun / SLURM) or default.",
        epilog="examples:\n  shardcache config\n  SHARDCACHE_SCOPE=node shardcache config --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_argument("--json", action="store_true", help="machine-readable output")
    config.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings, errors = Settings.diagnose()
    rows = settings.describe()
    if args.json:
        out = {}
        for name, env, value, source in rows:
            text = format_setting(name, value)
            out[name] = {"value": _jsonable(value), "text": text, "env": env, "source": source}
            if name in errors:
                out[name] |= {"value": None, "text": None, "error": common.one_line(errors[name])}
        common.write_json(out)
    else:
        width = max(len(name) for name, *_ in rows)
        for name, env, value, source in rows:
            shown = "INVALID (below)" if name in errors else format_setting(name, value)
            sys.stdout.write(f"{name:<{width}}  {shown:<40}  {source}  [{env}]\n")
            if name in errors:
                sys.stdout.write(f"  error: {common.one_line(errors[name])}\n")
    if errors:
        sys.stderr.write(
            f"shardcache config: invalid: {', '.join(errors)} (the error is shown under each; "
            "the other settings are as resolved)\n"
        )
        return common.EXIT_USAGE
    return common.EXIT_OK


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    return value
