"""The maintenance commands of ``shardcache``: ``status`` and ``clean`` (one scope or
``--all``), ``evict`` down to a size, and ``verify``; the work itself is ``_ops.maintenance``'s
and ``_ops.verify``'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._base.errors import ConfigError
from .._config.parse import parse_size
from . import common

EVICT_LIST_LIMIT = 20  # removed shards listed by "evict" (all of them with --json)


def add(commands: Any) -> None:
    status = common.command(
        commands,
        "status",
        "show entries (--list: each shard), disk, locks held, stale locks and orphan files",
        "Show the cache directory's shards and bytes (--list: each shard, its size and when "
        "it was last used), the free disk, downloads in progress, "
        "every lock held right now and by whom (host, pid, rank, phase, bytes, alive?), "
        "stale locks (leases of dead processes) and orphan files (temp files of killed "
        "downloads, metadata of shards that are gone), and the other scope directories of "
        "the root. Changes nothing. Exit code 1 when the scope directory does not exist (the "
        "message names the ones the root holds).",
        [
            "shardcache status",
            "shardcache status --list",
            "shardcache status --json --scope node",
            "shardcache status --rank 3",
            "shardcache status --all",
        ],
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--list",
        action="store_true",
        help="list every cached shard: URL, size, last used (--json: as 'shards')",
    )
    status.add_argument(
        "--all",
        action="store_true",
        help="every rank-N and node directory under the cache root, in one table",
    )
    common.cache_options(status)
    status.set_defaults(func=_cmd_status)

    clean = common.command(
        commands,
        "clean",
        "remove stale locks and orphan temp files",
        "Remove exactly what 'status' reports as stale or orphan, checking each item again "
        "right before removing it. Never removes a .lock file, a lock of a live holder, or "
        "a download of a living process. Safe to run while jobs use the cache. --dry-run "
        "lists what would be removed and removes nothing.",
        [
            "shardcache clean",
            "shardcache clean --dry-run",
            "shardcache clean --json --cache-dir /local/ssd/cache",
            "shardcache clean --all",
        ],
    )
    clean.add_argument("--json", action="store_true", help="machine-readable output")
    _dry_run_option(clean)
    clean.add_argument(
        "--all", action="store_true", help="every rank-N and node directory under the cache root"
    )
    common.cache_options(clean)
    clean.set_defaults(func=_cmd_clean)

    evict = common.command(
        commands,
        "evict",
        "evict least-recently-used shards down to a size",
        "Remove least-recently-used shards until the cache (shards plus downloads in "
        "progress) fits in SIZE (decimal, as sizes are printed: 500G is 500 GB; binary with "
        "i: 500GiB). Shards in use by a reader are never removed. --dry-run lists what would "
        "be removed and removes nothing. Exit code 2 when neither --max-bytes nor "
        "SHARDCACHE_MAX_BYTES gives a size.",
        [
            "shardcache evict --max-bytes 500G",
            "shardcache evict --max-bytes 500G --dry-run",
            "SHARDCACHE_MAX_BYTES=1.5T shardcache evict",
        ],
    )
    evict.add_argument(
        "--max-bytes",
        type=_size,
        metavar="SIZE",
        help="target size, e.g. 500G (default: SHARDCACHE_MAX_BYTES); 0 evicts all unused",
    )
    evict.add_argument("--json", action="store_true", help="machine-readable output")
    _dry_run_option(evict)
    common.cache_options(evict)
    evict.set_defaults(func=_cmd_evict)

    verify = common.command(
        commands,
        "verify",
        "re-check cached shards against the remote (or a manifest); remove bad ones",
        "Check every cached shard: its size against the remote object's, its content against "
        "the object's full-object S3 checksum and a single-part object's ETag (MD5), and "
        "that the ETag has not changed since download; or, "
        "for URLs a JSON manifest lists with size / md5 / sha256, against those. Bad shards "
        "are removed (the next fetch downloads them again) and listed. Shards without a "
        "metadata record are reported as of unknown origin and left alone. Exit code 1 when "
        "a shard was bad or could not be checked, else 0. With --quick, only each shard's "
        "size against the one recorded when it was cached (nothing read, no source asked). "
        "Progress on stderr as 'warm' shows it, the report on stdout.",
        [
            "shardcache verify",
            "shardcache verify --manifest shards.json --threads 8",
            "shardcache verify --quick",
        ],
    )
    verify.add_argument(
        "--quick",
        action="store_true",
        help="only compare each shard's size with its metadata record (local, seconds)",
    )
    verify.add_argument(
        "--manifest", metavar="F", help='JSON manifest of {"url", "size", "md5"/"sha256"}'
    )
    verify.add_argument(
        "--threads", type=common.positive_int, help="parallel checks (default: SHARDCACHE_THREADS)"
    )
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    common.cache_options(verify)
    verify.set_defaults(func=_cmd_verify)


def _dry_run_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", "--dry-run", action="store_true", help="list what would be removed; remove nothing"
    )


def _size(text: str) -> int:
    try:
        return parse_size(text, "--max-bytes")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(common.one_line(exc)) from None


def _emit(report: Any, as_json: bool) -> None:
    if as_json:
        common.write_json(report.as_json())
    else:
        sys.stdout.write(report.format() + "\n")


def _all_scopes(args: argparse.Namespace) -> bool:
    """Whether ``--all`` was given (never with ``--scope`` or ``--rank``)."""
    if args.all and (args.scope is not None or args.rank is not None):
        raise common.UsageError(
            f"--all covers every scope: give {args.command} --all without --scope or --rank"
        )
    return bool(args.all)


def _cmd_status(args: argparse.Namespace) -> int:
    from .._ops.maintenance import status, status_all

    _emit(
        status_all(common.settings_for(args), list_shards=args.list)
        if _all_scopes(args)
        else status(common.cache_for(args), list_shards=args.list),
        args.json,
    )
    return common.EXIT_OK


def _cmd_clean(args: argparse.Namespace) -> int:
    from .._ops.maintenance import clean, clean_all

    dry_run = args.dry_run
    report = (
        clean_all(common.settings_for(args), dry_run=dry_run)
        if _all_scopes(args)
        else clean(common.cache_for(args), dry_run=dry_run)
    )
    _emit(report, args.json)
    return common.EXIT_FAILED if report.failed else common.EXIT_OK


def _cmd_evict(args: argparse.Namespace) -> int:
    from .._base.units import format_bytes
    from .._ops.maintenance import evict_preview, require_scope_dir

    cache = common.cache_for(args)
    limit = args.max_bytes if args.max_bytes is not None else cache.settings.max_bytes
    if limit is None:
        raise common.UsageError("give --max-bytes SIZE (e.g. 500G) or set SHARDCACHE_MAX_BYTES")
    require_scope_dir(cache.settings)
    report = evict_preview(cache, limit) if args.dry_run else cache.evict(limit)
    if args.json:
        out = {
            "scope_dir": str(cache.settings.scope_dir),
            "dry_run": args.dry_run,
            "max_bytes": limit,
            "removed": [
                {"path": str(e.path), "url": e.url, "size": e.size, "last_used": e.last_used}
                for e in report.removed
            ],
            "freed_bytes": report.freed_bytes,
            "kept_bytes": report.kept_bytes,
            "in_use": report.in_use,
        }
        common.write_json(out)
        return common.EXIT_OK
    dry = args.dry_run
    done, freed, left = (
        ("would remove", "to free", "would stay") if dry else ("removed", "freed", "kept")
    )
    lines = [
        f"evict {cache.settings.scope_dir} to {format_bytes(limit)} ({limit} bytes): {done} "
        f"{len(report.removed)} shards ({format_bytes(report.freed_bytes)} {freed}), "
        f"{format_bytes(report.kept_bytes)} {left}, {report.in_use} in use skipped"
        + ("; --dry-run: nothing removed" if dry else "")
    ]
    shown = report.removed[:EVICT_LIST_LIMIT]
    lines += [f"  {e.url or e.path} ({format_bytes(e.size)})" for e in shown]
    if len(report.removed) > len(shown):
        lines.append(f"  ... and {len(report.removed) - len(shown)} more (--json lists all)")
    sys.stdout.write("\n".join(lines) + "\n")
    return common.EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from .._ops.verify import verify

    report = verify(
        common.cache_for(args),
        args.manifest,
        threads=args.threads,
        quick=args.quick,
        stream=sys.stderr,
    )
    _emit(report, args.json)
    return common.EXIT_FAILED if report.failed else common.EXIT_OK
