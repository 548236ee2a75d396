"""What the commands of ``shardcache`` share: exit codes, the usage error, argument types
and groups (cache options, specs), the settings and cache the arguments name, and output
helpers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._config.settings import Settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + the signal's number, as a shell gives


class UsageError(Exception):
    """A usage error found after parsing (reported like argparse's: one line, exit 2)."""


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
        return value

    return parse


positive_int, non_negative_int = int_at_least(1), int_at_least(0)


def command(
    commands: Any, name: str, help: str, description: str, examples: Sequence[str]
) -> argparse.ArgumentParser:
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    return commands.add_parser(  # type: ignore[no-any-return]
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def cache_options(parser: argparse.ArgumentParser, *, rank: bool = True) -> None:
    group = parser.add_argument_group("cache")
    group.add_argument(
        "--cache-dir", type=Path, help="cache root (default: SHARDCACHE_DIR, else $TMPDIR/...)"
    )
    group.add_argument(
        "--scope", choices=("rank", "node"), help="rank or node cache (default: SHARDCACHE_SCOPE)"
    )
    if rank:
        group.add_argument(
            "--rank",
            type=non_negative_int,
            help="with rank scope: whose rank-<N> directory (default: this process's rank)",
        )


def spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("specs", nargs="*", metavar="SPEC", help="URL or brace pattern")
    parser.add_argument(
        "--from-file",
        action="append",
        default=[],
        metavar="F",
        help="manifest: one URL or pattern per line (# comments), or a JSON list (repeatable)",
    )


def settings_for(args: argparse.Namespace) -> Settings:
    overrides = {"cache_dir": args.cache_dir, "scope": args.scope}
    if getattr(args, "rank", None) is not None:
        overrides["rank"] = args.rank
    return Settings.resolve(**overrides)


def cache_for(args: argparse.Namespace) -> Any:
    from .._cache.shard_cache import ShardCache

    return ShardCache(settings=settings_for(args))


def specs_of(args: argparse.Namespace) -> list[str]:
    """The SPEC arguments and ``--from-file`` manifests, as expand_urls takes them."""
    specs = list(args.specs) + [f"@{path}" for path in args.from_file]
    if not specs:
        raise UsageError("give at least one SPEC or --from-file F")
    return specs


def write_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
