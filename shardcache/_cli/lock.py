"""``shardcache lock``: write the dataset lockfile of a shard list, or compare the shards
with one (``--diff``: exit code 1 when any changed, each named).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import common


def add(commands: Any) -> None:
    lock = common.command(
        commands,
        "lock",
        "write a dataset lockfile of a shard list, or diff the shards against one",
        "Record the identity of every shard of the specs (size, ETag, version id where the "
        "bucket keeps versions, the store's checksum; a local file's modification time) in "
        "FILE, for ResumableDataset(SPEC, lock=FILE): a resume then reads the recorded "
        "versions of shards that changed, or names them. A shard the cache holds is "
        "described by its metadata record (no request), any other by one HEAD. With --diff "
        "FILE, compare the shards (the specs', else the lock's own) with the lock as the "
        "store has them now (--cached: as this cache holds them, where it does): exit code "
        "0 when none changed, 1 listing each that did (and each not in the lock). --json "
        "prints the summary or the differences as JSON.",
        [
            "shardcache lock 's3://bucket/train-{000000..000127}.tar' -o dataset.lock.json",
            "shardcache lock --diff dataset.lock.json",
            "shardcache lock --diff dataset.lock.json 's3://bucket/train-{000000..000127}.tar'",
        ],
    )
    common.spec_arguments(lock)
    target = lock.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "-o", "--output", metavar="FILE", help="write the lock: a local path or an fsspec URL"
    )
    target.add_argument(
        "--diff", metavar="FILE", help="compare the shards with the lock FILE (path or URL)"
    )
    lock.add_argument(
        "--cached",
        action="store_true",
        help="--diff: a shard the cache holds as its copy's record says (no request)",
    )
    lock.add_argument(
        "--threads",
        type=common.positive_int,
        help="parallel HEAD requests (default: SHARDCACHE_THREADS)",
    )
    lock.add_argument("--json", action="store_true", help="machine-readable output")
    common.cache_options(lock, rank=False)
    lock.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.diff is not None:
        return _diff(args)
    from .._base.url_kinds import LOCAL_PROTOCOLS, url_protocol
    from .._datasets.dataset_lock import identities, make_lock, write_lock
    from .._datasets.urls import expand_urls

    urls = expand_urls(common.specs_of(args))
    cache = common.cache_for(args)
    now, asked = identities(urls, cache, threads=args.threads or cache.settings.threads)
    lock = write_lock(args.output, make_lock(now))
    remote = sum(1 for url in urls if url_protocol(url) not in LOCAL_PROTOCOLS)
    summary = {
        "lock": args.output,
        "shards": len(urls),
        "digest": lock.digest,
        "from_cache": remote - asked,
        "requests": asked,
    }
    if args.json:
        common.write_json(summary)
    else:
        sys.stdout.write(
            f"lock: {len(urls)} shards written to {args.output} (digest {lock.digest}; "
            f"{remote - asked} described by the cache, {asked} asked with HEAD)\n"
        )
    return common.EXIT_OK


def _diff(args: argparse.Namespace) -> int:
    from .._datasets.dataset_lock import changes, identities, read_lock
    from .._datasets.urls import expand_urls

    lock = read_lock(args.diff)
    if lock is None:
        raise common.UsageError(f"--diff {args.diff}: no such lock file")
    given = args.specs or args.from_file
    urls = expand_urls(common.specs_of(args)) if given else list(lock.shards)
    unknown = lock.missing(urls)
    known = [url for url in urls if url not in set(unknown)]
    cache = common.cache_for(args)
    now, asked = identities(
        known, cache, threads=args.threads or cache.settings.threads, from_cache=args.cached
    )
    changed = changes(lock, now)
    if args.json:
        common.write_json(
            {
                "lock": args.diff,
                "shards": len(urls),
                "changed": [change.as_json() for change in changed],
                "not_in_lock": unknown,
                "requests": asked,
            }
        )
    elif changed or unknown:
        lines = [change.line() for change in changed]
        lines += [f"{url}: not in the lock" for url in unknown]
        sys.stdout.write(
            f"{len(changed) + len(unknown)} of {len(urls)} shards differ from {args.diff}:\n"
            + "".join(f"  {line}\n" for line in lines)
        )
    else:
        sys.stdout.write(f"all {len(urls)} shards match {args.diff}\n")
    return common.EXIT_FAILED if changed or unknown else common.EXIT_OK
