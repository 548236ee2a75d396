"""``shardcache index``: fetch a shard list through the cache and write its sample index
(a local file or an fsspec URL), checking the target before anything is fetched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from . import common


def add(commands: Any) -> None:
    index = common.command(
        commands,
        "index",
        "write the sample index of a shard list (for ResumableDataset, warm --split dataset)",
        "Fetch every shard of the specs through the cache, several at a time, read where "
        "each sample starts, and write the sample index of the shard list to FILE (a local "
        "path, written atomically, or an fsspec URL such as s3://bucket/train.index.json). "
        "shardcache.ResumableDataset(SPEC, index=FILE) then splits epochs by samples "
        "without fetching every shard first, and 'shardcache warm --split dataset --index "
        "FILE' warms exactly each task's shards. Run it once for a shard list (not on every "
        "rank), and again when the shards change. The shards stay cached, so a later warm "
        "or training on this machine finds them. Progress on stderr as 'warm' shows it, a "
        "summary on stdout (--json: as JSON). The first shard that cannot be fetched or "
        "read stops the run: exit code 1 and nothing written. Shards that hold no sample "
        "are reported as a warning.",
        [
            "shardcache index 's3://bucket/train-{000000..000127}.tar' -o train.index.json",
            "shardcache index --from-file shards.txt -o s3://bucket/train.index.json --json",
        ],
    )
    common.spec_arguments(index)
    index.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="where to write the index: a local path or an fsspec URL",
    )
    index.add_argument(
        "--threads",
        type=common.positive_int,
        help="parallel downloads (default: SHARDCACHE_THREADS)",
    )
    index.add_argument("--json", action="store_true", help="machine-readable summary")
    common.cache_options(index, rank=False)
    index.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .._datasets.sample_index import index_document
    from .._datasets.urls import expand_urls
    from ..warm import build_index

    urls = expand_urls(common.specs_of(args))
    target = args.output
    _check_output(target)
    cache = common.cache_for(args)
    threads = args.threads or cache.settings.threads
    sys.stderr.write(
        f"index: {len(urls)} shards through {cache.settings.scope_dir} with {threads} threads\n"
    )
    sys.stderr.flush()
    result = build_index(cache, urls, threads=threads, stream=sys.stderr)
    _write_index(target, index_document(result.index, urls))
    if args.json:
        common.write_json(result.as_json(target))
    else:
        sys.stdout.write(result.summary(target) + "\n")
    return common.EXIT_OK


def _check_output(target: str) -> None:
    """``-o`` must be a file in an existing local directory, or a URL of a known fsspec
    protocol (checked before anything is fetched)."""
    if "://" in target and not target.startswith("file://"):
        import fsspec

        protocol = target.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise common.UsageError(f"-o {target}: {common.one_line(exc)}") from None
        return
    path = Path(target.removeprefix("file://"))
    if path.is_dir():
        raise common.UsageError(f"-o {target} is a directory: give the index file's path")
    if not path.parent.is_dir():
        raise common.UsageError(f"-o {target}: directory {path.parent} does not exist")


def _write_index(target: str, document: dict[str, Any]) -> None:
    from .._base.errors import SampleIndexError
    from .._datasets.sample_index import write_index

    try:
        write_index(target, document)
    except OSError as exc:  # fsspec targets (local ones raise SampleIndexError)
        raise SampleIndexError(
            f"cannot write the sample index {target}: {type(exc).__name__}: "
            f"{common.one_line(exc)}; check the bucket and the credentials, or choose another -o",
            path=target,
        ) from None
