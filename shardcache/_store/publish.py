"""Publishing a download: a private temp file (room made and its size reserved under the
scope's eviction lock), then its metadata record and a durable rename into place.

    with publisher.begin(shard, info) as part:
        ...  # download into part.file()
        part.written(info)
        part.commit(info)

Invariant: the lock only avoids downloading a shard twice. Correctness comes from the
per-process temp file renamed into place: a reader only ever opens the final name, which
exists only once complete and verified, so no reader can see a partial shard even if a
writer is SIGKILLed at any instant (it leaves only its ``.part``, removed later by
:mod:`shardcache._store.leftovers`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .._base.errors import CacheDirError, ShardCacheError
from .._base.redact import get_logger, redact_url
from .._base.safefs import SafeFS
from .._base.writeback import WriteBehind
from .._disk.layout import CacheLayout, ShardId
from .._disk.metadata import write_meta
from .eviction import evict_lock
from .space import Space

if TYPE_CHECKING:
    from .._config.settings import Settings
    from .._transfer.download import ObjectInfo

logger = get_logger("shardcache._cache")  # the cache's records keep one logger name

WriteMeta = Callable[[CacheLayout, Path, dict[str, Any]], None]
"""Writes a shard's metadata record (:func:`~shardcache._disk.metadata.write_meta`)."""

VANISHED_RETRIES = 8  # a step is made again at most this often when its files vanish
_VANISHED_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE})


class Vanished(Exception):
    """A directory or file of the cache vanished mid-fetch (``path``): fetch again."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


class DiskFull(Exception):
    """One download attempt stopped on a full disk (the OSError is ``__cause__``) after
    writing ``written`` bytes."""

    def __init__(self, written: int) -> None:
        super().__init__(written)
        self.written = written


class Publisher:
    """Publishes downloads into the scope laid out as ``layout``, within ``space``; each
    shard's metadata record written by ``write_meta``."""

    def __init__(
        self,
        layout: CacheLayout,
        space: Space,
        settings: Settings,
        *,
        write_meta: WriteMeta = write_meta,
    ) -> None:
        self._layout = layout
        self._space = space
        self._settings = settings
        self._write_meta = write_meta

    @contextlib.contextmanager
    def begin(self, shard: ShardId, info: ObjectInfo) -> Iterator[Part]:
        """A new temp file for ``shard``'s download of ``info``, closed on the way out.

        On any failure it is removed and nothing is published; a local I/O error becomes
        what the miss path acts on: :class:`Vanished` (a directory of the cache was
        removed), :class:`DiskFull` (ENOSPC/EDQUOT), else a :class:`CacheDirError`."""
        final = shard.data_path
        part = self._layout.temp_path(final)
        fd: int | None = None
        try:
            fd = self._create_reserved_part(part, final, info)
            sized_ahead = info.size is not None
            yield Part(
                shard,
                part,
                fd,
                sized_ahead=sized_ahead,
                layout=self._layout,
                space=self._space,
                write_meta=self._write_meta,
            )
        except BaseException as exc:
            _unlink_quietly(self._layout.fs, part)
            # Local I/O only: remote errors arrive as FetchError (a ShardCacheError).
            if isinstance(exc, OSError) and not isinstance(exc, ShardCacheError):
                raise self._local_error(exc, part, fd, info) from exc
            raise
        finally:
            if fd is not None:
                os.close(fd)

    def _local_error(self, exc: OSError, part: Path, fd: int | None, info: ObjectInfo) -> Exception:
        if exc.errno in _VANISHED_ERRNOS:  # our directory (and the .part in it) was removed
            return Vanished(Path(exc.filename or part))
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFull(_written(fd))
        return CacheDirError(
            f"cannot write {part} while caching {info.url}: {exc}. Check that "
            f"{self._settings.scope_dir} is a writable directory on a healthy file system "
            "(SHARDCACHE_DIR); nothing was published.",
            path=str(part),
            url=info.url,
            errno=exc.errno,
        )

    def _create_reserved_part(self, part: Path, final: Path, info: ObjectInfo) -> int:
        """Make room for ``info`` (evicting), create ``part`` and reserve its size, all under
        the scope's eviction lock: the next process's count includes this download, so
        published + reserved in-flight bytes never exceed SHARDCACHE_MAX_BYTES. A size not
        known ahead (``pipe:``) reserves nothing: the room is made once the download ended
        (:meth:`Part.written`), and meanwhile the evictor counts the ``.part`` as it grows."""
        if info.size is None:
            if self._space.index() is None:
                return self._create_part(part)
            with evict_lock(self._layout):
                self._space.add_part(part, final)
                return self._create_part(part)
        with evict_lock(self._layout):
            self._space.make_room(final, info)
            # Registered before the file exists: no part is ever uncounted.
            self._space.add_part(part, final)
            fd = self._create_part(part)
            try:
                self._space.reserve(fd, info)
            except BaseException:
                os.close(fd)
                raise
            return fd

    def _create_part(self, part: Path) -> int:
        """Create the download file ``part``, making its directory again if it vanished."""
        for _ in range(VANISHED_RETRIES):
            try:
                # O_RDWR: a parallel download hashes the file back from disk to verify it.
                fd = self._layout.fs.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileNotFoundError:
                self._layout.make_dir(part.parent)
                continue
            try:
                self._layout.trust.adopt_file(fd, self._layout.trust.file_mode)
                _hold_while_written(fd)
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise Vanished(part.parent)


class Part:
    """One download's private temp file ``path`` (open as ``fd``), to be published as
    ``shard``'s data file; ``sized_ahead``: the object's size was known when it began."""

    def __init__(
        self,
        shard: ShardId,
        path: Path,
        fd: int,
        *,
        sized_ahead: bool,
        layout: CacheLayout,
        space: Space,
        write_meta: WriteMeta,
    ) -> None:
        self._shard = shard
        self._sized_ahead = sized_ahead
        self.path = path
        self.fd = fd
        self._layout = layout
        self._space = space
        self._write_meta = write_meta
        self._write_behind = WriteBehind(fd)

    def file(self) -> BinaryIO:
        """The temp file to write the download into. The descriptor outlives the file
        object: publishing may need the bytes again."""
        return os.fdopen(self.fd, "wb", closefd=False)

    def progressed(self, bytes_done: int) -> None:
        """``bytes_done`` bytes of the download are in the file (reported from one thread):
        their write-back to disk is started every few MiB, so that :meth:`written`'s fsync
        waits for the last few only."""
        self._write_behind.wrote(bytes_done)

    def written(self, info: ObjectInfo) -> None:
        """The download of ``info`` ended: its bytes made durable and, for a size not
        known ahead, room made for them now that it is known (within the limit)."""
        os.fsync(self.fd)
        if not self._sized_ahead and self._space.bounded:
            with evict_lock(self._layout):
                self._space.make_room(self._shard.data_path, info, on_disk=True)

    def commit(self, info: ObjectInfo) -> int:
        """Record ``info`` as the shard's metadata, then publish the verified download;
        the published file's size."""
        self._write_meta(self._layout, self._shard.data_path, _record(self._shard, info, self.fd))
        # Published, it is a shard that readers pin and the evictor may take: no longer held
        # as a download (a DataLoader worker forked meanwhile holds the descriptor too).
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        self._publish(self._shard.data_path)
        return os.fstat(self.fd).st_size

    def _publish(self, final: Path) -> None:
        """Rename the verified download to ``final`` durably.

        If the directory was removed meanwhile (a tmp cleaner), the verified bytes are
        still ours through ``fd``: copy them into a new temp file in the recreated
        directory and publish that, instead of downloading again.

        With SHARDCACHE_MAX_BYTES this runs under the eviction lock: a rename while an
        evictor lists the directory could hide the file under both names (readdir need
        not return an entry renamed during the listing) and the count would fall short."""
        with evict_lock(self._layout) if self._space.bounded else contextlib.nullcontext():
            self._publish_locked(final)
            self._space.published(self.path, final)

    def _publish_locked(self, final: Path) -> None:
        part = self.path
        try:
            for _ in range(VANISHED_RETRIES):
                try:
                    self._layout.fs.replace(part, final)
                    self._layout.fs.fsync_dir(final.parent)
                    return
                except FileNotFoundError:
                    if os.fstat(self.fd).st_nlink:
                        raise  # not our directory's removal: let the caller judge
                logger.info("%s was removed before it was published; publishing a copy", part)
                self._layout.make_dir(final.parent)
                part = self._layout.temp_path(final)
                _copy_file(self.fd, part, self._layout.fs)
            raise Vanished(final.parent)
        except BaseException:
            if part != self.path:
                _unlink_quietly(self._layout.fs, part)
            raise


SIZE_ONLY = "size"
"""The verification method of a copy checked against nothing but the object's size."""


def verified_method(info: ObjectInfo) -> str:
    """How a download that returned ``info`` was verified, as records and counts name it: the
    checksum's method (``crc64nvme``, ``md5``, ``md5-parts``, ...), else :data:`SIZE_ONLY`."""
    return info.verified.method if info.verified is not None else SIZE_ONLY


def _record(shard: ShardId, info: ObjectInfo, fd: int) -> dict[str, Any]:
    """The metadata record of ``shard``'s download of ``info`` (open as ``fd``)."""
    url = shard.canonical_url
    return {
        # Never a credential on disk: a presigned URL's signature or a password
        # in it is recorded as ***, flagged so that verify knows it cannot reuse it.
        "url": redact_url(url),
        "url_redacted": redact_url(url) != url,
        "namespace": redact_url(shard.namespace),
        "size": info.size,
        "etag": info.etag,
        "md5": info.md5,
        # The store's own checksum, and what this copy was checked against
        # beyond its size ("crc64nvme", ..., "md5"; "md5-parts", "crc32-parts", ... for a
        # multipart upload's, with the parts' sizes; "size" for nothing more).
        "checksum": info.checksum.as_record() if info.checksum else None,
        "verified": verified_method(info),
        "parts": info.parts_layout.as_record() if info.parts_layout else None,
        # The CRC32C of this copy's bytes, hashed as they landed: peers of the cache mesh
        # check it against this (present for size-only stores too).
        "mesh_crc32c": info.mesh_crc32c,
        "version_id": info.version_id,
        "mtime_ns": info.mtime_ns,
        "data_ino": os.fstat(fd).st_ino,  # the copy this record describes
        "fetched_at": time.time(),
    }


def _copy_file(src_fd: int, dest: Path, fs: SafeFS) -> None:
    """Copy all of ``src_fd`` into the new file ``dest`` (in the kernel), durably."""
    size = os.fstat(src_fd).st_size
    out = fs.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fs.trust.adopt_file(out, fs.trust.file_mode)
        offset = 0
        while offset < size:
            sent = os.sendfile(out, src_fd, offset, size - offset)
            if sent == 0:
                raise OSError(errno.EIO, f"short copy into {dest}", str(dest))
            offset += sent
        os.fsync(out)
    except BaseException:
        os.close(out)
        _unlink_quietly(fs, dest)
        raise
    os.close(out)


def _hold_while_written(fd: int) -> None:
    """Hold a shared ``flock`` on a new download file: while it is held, no process takes
    it for a dead writer's leftover (:mod:`shardcache._store.leftovers`), even one that
    cannot see this process's pid. A file system without flocks goes without."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        logger.debug("cannot hold a flock on a download file (%s): judged by its pid alone", exc)


def _written(fd: int | None) -> int:
    """Bytes in the (possibly unlinked) download file ``fd``; 0 when unknown."""
    if fd is None:
        return 0
    try:
        return os.fstat(fd).st_size
    except OSError:
        return 0


def _unlink_quietly(fs: SafeFS, path: Path) -> None:
    """Remove a temp file; one that cannot be removed (a read-only file system) is left for
    ``shardcache clean`` with a warning, never raised over the error being reported."""
    try:
        fs.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s (%s); `shardcache clean` removes it later", path, exc)
