"""A fetching process that stops at a chosen instant and tells its parent, which SIGKILLs it.

Usage: ``python crash_child.py CACHE_DIR URL LOCK_MODE INSTANT OFFSET``. The child prints
``AT <instant>`` on stdout when it reaches the instant, then blocks reading stdin (the
parent kills it there). ``INSTANT`` is one of :data:`INSTANTS`; ``OFFSET`` is the byte
count at which ``download`` stops. ``random`` prints ``GO`` right before fetching and lets
the parent kill it after a random delay, wherever it is.
"""

from __future__ import annotations

import os
import sys

INSTANTS = (
    "locked",  # lock held, nothing downloaded yet
    "download",  # mid-download, at a random byte offset
    "verify",  # every byte written, verifying
    "meta",  # metadata record written, shard not yet renamed
    "rename",  # right before the rename into place
    "renamed",  # right after the rename, before the directory fsync and unlock
    "random",  # anywhere: killed after a random delay
)


def _stop(instant: str) -> None:
    sys.stdout.write(f"AT {instant}\n")
    sys.stdout.flush()
    sys.stdin.readline()  # the parent SIGKILLs us here; EOF only if it went away
    os._exit(3)


def main() -> None:
    cache_dir, url, lock_mode, instant, offset = sys.argv[1:6]
    stop_at = int(offset)

    from shardcache import ShardCache, cache, locks, remote

    c = ShardCache(cache_dir, scope="node", lock_mode=lock_mode, chunk_size=4096)
    final = c.path_for(url)

    if instant == "locked":
        real_acquire = locks.ShardLock.acquire

        def acquire(self, done=None):
            got = real_acquire(self, done)
            if got and self.url == url:
                _stop(instant)
            return got

        locks.ShardLock.acquire = acquire
    elif instant == "verify":
        real_verify = remote.Remote._verify

        def verify(self, *args, **kw):
            _stop(instant)
            return real_verify(self, *args, **kw)

        remote.Remote._verify = verify
    elif instant == "meta":
        real_write_meta = cache.write_meta

        def write_meta(*args, **kw):
            real_write_meta(*args, **kw)
            _stop(instant)

        cache.write_meta = write_meta
    elif instant in ("rename", "renamed"):
        real_replace = os.replace

        def replace(src, dst, *args, **kw):
            if os.fspath(dst) == os.fspath(final):
                if instant == "rename":
                    _stop(instant)
                real_replace(src, dst, *args, **kw)
                _stop(instant)
            return real_replace(src, dst, *args, **kw)

        os.replace = replace

    def progress(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        if instant == "download" and phase == "downloading" and bytes_done >= stop_at:
            _stop(instant)

    if instant == "random":
        sys.stdout.write("GO\n")
        sys.stdout.flush()
    c.fetch(url, progress=progress)
    sys.stdout.write("DONE\n")
    sys.stdout.flush()
    sys.stdin.readline()


if __name__ == "__main__":
    main()
