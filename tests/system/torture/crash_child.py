"""A fetching process that stops at a chosen instant and tells its parent, which SIGKILLs it.

The parent starts :func:`run` in a process forked from a multiprocessing fork server that
has imported this module (and with it shardcache, s3fs and aiobotocore) once, so a child
costs a fork rather than a second of imports. ``argv`` is ``CACHE_DIR URL LOCK_MODE PATH
INSTANT OFFSET``; ``PATH`` is a key of :data:`PATHS` (how the shard is downloaded: a local
file, one S3 GET stream, or parallel ranged S3 GETs); for S3 the endpoint comes from the
``AWS_*`` variables of ``env``, which replaces the child's environment.

The child sends ``AT <instant> <seconds since the fetch began> <thread>`` on its pipe when
it reaches the instant, then blocks reading the pipe: the parent SIGKILLs it there, which
is the crash. ``INSTANT`` is one of :data:`INSTANTS`. For ``download``, ``OFFSET`` is the
number of bytes received from the store (over all parts) after which the receiving thread
stops, holding the chunk that crossed it; every other receiving thread stops at its next
chunk. ``random`` sends ``GO`` right before fetching and lets the parent kill it after a
random delay, wherever it is then; a fetch that completes sends ``DONE <seconds>``.

Only the stop is instrumented: the fetch itself is the library's own code, talking to the
real server (through the parent's fault proxy) and the real file system.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import s3fs  # noqa: F401  (imported once by the fork server, with aiobotocore)
from fsspec.asyn import sync

from shardcache import Settings, ShardCache
from shardcache._base import safefs
from shardcache._cache.shard_cache import Wiring
from shardcache._locking import shard_lock as locks
from shardcache._transfer import download
from shardcache._transfer import stream_download as download_stream

INSTANTS = (
    "locked",  # lock held, nothing requested yet (not even the GET)
    "download",  # mid-download, after a random number of bytes received
    "verify",  # every byte written, about to verify
    "meta",  # metadata record written, shard not yet renamed
    "rename",  # right before the rename into place
    "renamed",  # right after the rename, before the directory fsync and unlock
    "random",  # anywhere: killed after a random delay
)

# ShardCache keyword overrides per download path. Shards are a few hundred KB: "parts"
# fetches them as 64 KB ranged GETs, four in flight; "single" as one GET stream.
_COMMON: dict[str, Any] = {"scope": "node", "chunk_size": 4096}
PATHS: dict[str, dict[str, Any]] = {
    "local": {**_COMMON},
    "single": {**_COMMON, "parallel_parts": 1},
    "parts": {
        **_COMMON,
        "parallel_threshold": 128 << 10,
        "part_size": 64 << 10,
        "parallel_parts": 4,
    },
}

_stop_lock = threading.Lock()
_stopping = False
_began = [time.monotonic()]  # when the fetch began
_pipe: list[Connection] = []  # to the parent


def _say(line: str) -> None:
    _pipe[0].send(line)


def _stop(instant: str) -> None:
    """Report the instant once, then block until the parent's SIGKILL arrives."""
    global _stopping
    with _stop_lock:
        first, _stopping = not _stopping, True
    if first:
        elapsed = time.monotonic() - _began[0]
        _say(f"AT {instant} {elapsed:.4f} {threading.current_thread().name}")
    _block()


def _block() -> None:
    """Wait for the parent's SIGKILL; exit if the parent went away (its end closed)."""
    try:
        _pipe[0].recv()
    finally:
        os._exit(3)


def _instrument(instant: str, url: str, final: str, stop_at: int, *, local: bool) -> None:
    if instant == "locked":
        real_acquire = locks.ShardLock.acquire

        def acquire(self: Any, done: Any = None) -> bool:
            got = real_acquire(self, done)
            if got and self.url == url:
                _stop(instant)
            return got

        locks.ShardLock.acquire = acquire  # type: ignore[method-assign]
    elif instant == "download":
        received = [0]
        count_lock = threading.Lock()

        def counting(real: Any) -> Any:
            def wrapper(*args: Any, **kw: Any) -> Any:
                for chunk in real(*args, **kw):
                    with count_lock:
                        received[0] += len(chunk)
                        crossed = received[0] >= stop_at
                    if crossed:
                        _stop(instant)
                    yield chunk

            return wrapper

        # Every byte stream: each S3 response body (the whole-object GET and each ranged
        # part read it) or a local file's chunks.
        if local:
            stream = download_stream.StreamDownload
            stream.chunks = counting(stream.chunks)  # type: ignore[method-assign]
        else:
            download.read_body = counting(download.read_body)
    elif instant == "verify":
        real_verify = download.Strategy.verify

        def verify(self: Any, *args: Any, **kw: Any) -> None:
            _stop(instant)
            real_verify(self, *args, **kw)

        download.Strategy.verify = verify  # type: ignore[method-assign]
    elif instant in ("rename", "renamed"):
        real_replace = safefs.SafeFS.replace

        def replace(self: Any, src: Any, dst: Any) -> None:
            if os.fspath(dst) == final:
                if instant == "rename":
                    _stop(instant)
                real_replace(self, src, dst)
                _stop(instant)
            real_replace(self, src, dst)

        safefs.SafeFS.replace = replace  # type: ignore[method-assign]


def _wiring(instant: str) -> Wiring:
    """The cache's collaborators: the real ones, the metadata writer stopping after it
    wrote for ``meta``."""
    if instant != "meta":
        return Wiring()
    real_write_meta = Wiring().write_meta

    def write_meta(*args: Any, **kw: Any) -> None:
        real_write_meta(*args, **kw)
        _stop(instant)

    return Wiring(write_meta=write_meta)


def run(argv: list[str], env: dict[str, str], pipe: Connection) -> None:
    """The child's body (see the module docstring)."""
    cache_dir, url, lock_mode, path, instant, offset = argv
    os.environ.clear()
    os.environ.update(env)
    _pipe.append(pipe)
    settings = Settings.resolve(cache_dir=cache_dir, lock_mode=lock_mode, **PATHS[path])
    c = ShardCache._wired(settings, _wiring(instant))
    _instrument(instant, url, os.fspath(c.path_for(url)), int(offset), local=path == "local")
    if path != "local":
        # Build the S3 client now (no request is made) so the fetch timed below, and the
        # random kills spread over it, are the fetch itself.
        fs, _ = c.remote.filesystem(url)
        sync(fs.loop, fs.set_session)
    if instant == "random":
        _say("GO")
    _began[0] = time.monotonic()
    c.fetch(url)
    _say(f"DONE {time.monotonic() - _began[0]:.4f}")
    _block()
