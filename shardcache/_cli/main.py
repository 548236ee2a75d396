"""The ``shardcache`` command (also ``python -m shardcache``).

Exit codes: 0 success, 1 a shardcache error or a partial failure (some shards failed to
warm, bad shards found by ``verify``; the output says which), 2 usage error (one line on
stderr), 130 interrupted (SIGINT, Ctrl-C), 143 terminated (SIGTERM: ``scancel``, a time
limit, preemption). SIGTERM unwinds the command as Ctrl-C does: downloads in flight stop
and their temp files are removed, locks are released, and one line names the signal.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from .. import __version__
from .._base.errors import ConfigError, ShardCacheError, UrlError
from .._base.redact import RedactingFilter
from . import common, config, demo, index, lock, maintenance, report, warm


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt: whatever
    unwinds on Ctrl-C (a warm run's downloads, their temp files, the locks) unwinds alike."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one would cut the unwinding
    raise Terminated


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` within the block (unless it is ignored, as a parent
    may have decided, or this is not the main thread); the handler before is restored."""
    try:
        before = signal.getsignal(signal.SIGTERM)
        if before is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: signals are not ours to handle
        before = None
    try:
        yield
    finally:
        if before is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, before)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one clear line and exit code 2, and names the
    closest choice of a mistyped command or choice ("did you mean 'warm'?")."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(common.EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is None or value in choices:
            return
        names = [str(choice) for choice in choices]
        close = difflib.get_close_matches(str(value), names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        if isinstance(action, argparse._SubParsersAction):  # the command itself
            raise argparse.ArgumentError(
                None, f"unknown command {value!r}: {hint}(commands: {', '.join(names)})"
            )
        raise argparse.ArgumentError(
            action, f"invalid choice: {value!r}: {hint}(choose from {', '.join(names)})"
        )


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardcache",
        description="Fast, safe local caching of sharded training data from S3 / fsspec URLs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  shardcache warm 's3://bucket/train-{000000..000127}.tar' --threads 16\n"
        "  shardcache index 's3://bucket/train-{000000..000127}.tar' -o train.index.json\n"
        "  shardcache lock 's3://bucket/train-{000000..000127}.tar' -o dataset.lock.json\n"
        "  shardcache status\n"
        "  shardcache clean\n"
        "  shardcache evict --max-bytes 500G\n"
        "  shardcache verify\n"
        "  shardcache config --json\n"
        "  shardcache report /shared/metrics/job-1234 --plot wait.png\n"
        "  shardcache demo\n"
        "\nexit codes: 0 ok, 1 failed (or some shards failed), 2 usage error, 130 interrupted "
        "(SIGINT), 143 terminated (SIGTERM); an interrupted or terminated command removes "
        "its downloads' temp files first",
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for module in (
        config,
        demo,
        warm,
        index,
        lock,
        maintenance,
        report,
    ):  # in this order in --help
        module.add(commands)
    for command in commands.choices.values():  # -v after the command too: "warm -v ..."
        command.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,  # absent: the value before the command stands
            help="log debug details",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardcache`` console script."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(  # warnings as the command's own lines; -v: timed, by logger
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        if args.verbose
        else "shardcache: %(levelname)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:  # -v: botocore logs request headers
        handler.addFilter(RedactingFilter())
    try:
        with _sigterm_unwinds():
            return int(args.func(args))
    except common.UsageError as exc:
        prog = f"shardcache {args.command}"
        sys.stderr.write(f"{prog}: error: {exc} (see {prog} --help)\n")
        return common.EXIT_USAGE
    except (ConfigError, UrlError) as exc:
        sys.stderr.write(f"shardcache: {type(exc).__name__}: {common.one_line(exc)}\n")
        return common.EXIT_USAGE
    except ShardCacheError as exc:
        sys.stderr.write(f"shardcache: {type(exc).__name__}: {exc}\n")
        return common.EXIT_FAILED
    except Terminated:
        sys.stderr.write(f"shardcache: terminated by SIGTERM (exit {common.EXIT_TERMINATED})\n")
        return common.EXIT_TERMINATED
    except KeyboardInterrupt:
        sys.stderr.write(f"shardcache: interrupted by SIGINT (exit {common.EXIT_INTERRUPTED})\n")
        return common.EXIT_INTERRUPTED
