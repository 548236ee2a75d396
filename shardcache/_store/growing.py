"""Reading a shard while it downloads: the in-flight file as a reader may see it.

A download that may be read early writes through a :class:`GrowingFile`'s writer (the
``out`` handed to the download strategy) instead of a plain file object. Every write
reports where it landed, and the *watermark* is the contiguous prefix written so far in
the current attempt: a :class:`GrowingReader` only ever returns bytes below it, read from
its own descriptor of the same inode. The published file is unchanged: it still reaches
its final name only complete and verified (:mod:`shardcache._cache.shard_cache`).

Invariants:

- A reader sees no byte past the watermark and no end of file before the download was
  verified and published: the last read waits for the verdict. A failed verification
  (or any other failure) raises that error from the reader; no end of file is reported.
- A write below the watermark (a download started again from byte 0 after a failed
  verification, a ``pipe:`` command run again) lowers the watermark; if a reader was already
  given bytes past that point, the reader gets :class:`~shardcache.IntegrityError` even if
  the new attempt is published: the bytes it consumed failed verification.
- A reader holds a shared ``flock`` on the inode from the moment the ``.part`` exists, so
  once renamed into place the shard is pinned (:mod:`shardcache._store.pins`) until the reader
  closes, exactly as a reader of the published file pins it.
- A download that stops (its directory removed by a tmp cleaner, the disk full, a read
  error) is not the end for a reader that claimed it: the cache fetches the shard again
  (without offering that attempt to a reader) and hands the published, verified file to
  :meth:`GrowingFile.resumed`. The bytes already written are compared with it: the reader
  goes on from the published file if every byte it was given matches, and gets
  :class:`~shardcache.IntegrityError` if one does not. Only the cache's final failure
  (:meth:`GrowingFile.failed`) reaches the reader as an error.
- Writes that bypass the writer (the parallel ranged download writes parts with
  ``os.pwrite`` out of order) do not move the watermark: such a download is offered to
  no reader and is consumed once published, as before.
- No lock is held while calling out: the announcement (to the prefetcher) and the reader's
  stall check run outside the file's condition, so they cannot deadlock with a prefetcher.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .._base.errors import FetchError, IntegrityError, ShardCacheError
from .._observe import metrics
from .pins import pin_again

BytesLike = bytes | bytearray | memoryview
Announce = Callable[["GrowingFile"], None]
"""Called once, from the writing thread, when the first bytes of a download landed."""
UntilStall = Callable[[], float]
"""Seconds a reader may wait for more bytes; raises :class:`StallError` when there are none."""


class GrowingFile:
    """The in-flight download ``fd`` of the shard to be published at ``path``.

    The writing side (the cache) writes through :meth:`writer`, then calls :meth:`published`
    or :meth:`failed`. The reading side takes it with :meth:`claim` and reads it through
    :meth:`open`; a download nobody claimed hands its pin to the cache (:meth:`detach_pin`).
    """

    def __init__(self, fd: int, path: Path, url: str, announce: Announce) -> None:
        self.path = path
        self.url = url
        self._fd = fd
        self._announce = announce
        self._cond = threading.Condition()
        self._watermark = 0  # contiguous bytes written in this attempt
        self._handed = 0  # bytes given to the reader so far (its furthest read)
        self._size: int | None = None  # set once verified and published
        self._error: BaseException | None = None
        self._stopped = False  # this attempt stopped; the cache fetches the shard again
        self._kept_fd: int | None = None  # the stopped attempt's bytes, to compare with
        self._resumed_fd: int | None = None  # the published file a stopped reader goes on in
        self._announced = False
        self._reported = False  # a reader raised the error
        self.claimed = False  # a reader took it: the reader owns the pin
        self._detached = False  # the cache took the pin: too late to claim
        self._pin_fd: int | None = pin_again(fd)  # pinned from the start

    # -- the writing side ------------------------------------------------------------

    def writer(self) -> GrowingWriter:
        """The file object a download strategy writes into (positioned at 0)."""
        return GrowingWriter(self._fd, self)

    def wrote(self, offset: int, count: int) -> None:
        """``count`` bytes were written at ``offset``."""
        with self._cond:
            if offset < self._watermark:
                self._lower(offset)
            if offset == self._watermark:
                self._watermark += count
                self._cond.notify_all()
            first = not self._announced and self._watermark > 0
            self._announced = self._announced or first
        if first:
            self._announce(self)

    def truncated(self, size: int) -> None:
        """The file was cut to ``size`` bytes (a download starting again)."""
        with self._cond:
            if size < self._watermark:
                self._lower(size)

    def _lower(self, offset: int) -> None:
        """Bytes from ``offset`` on are being rewritten; called with the condition held."""
        if offset < self._handed and self._error is None:
            self._error = IntegrityError(
                f"{self.url}: the download was started again from byte {offset} after its "
                f"reader had consumed {self._handed} bytes (a failed verification, or a "
                "command run again): the samples already read came from bytes that were not "
                "verified and may be wrong. The shard is cached once verified; read it again, "
                "or set SHARDCACHE_READ_WHILE_DOWNLOADING=off to read only verified shards.",
                url=self.url,
                expected="bytes that pass verification",
                seen=f"a restart at byte {offset} after {self._handed} bytes were read",
            )
        self._watermark = offset
        self._cond.notify_all()

    def published(self, size: int) -> None:
        """The download was verified and renamed into place with ``size`` bytes."""
        with self._cond:
            self._watermark = self._size = size
            self._cond.notify_all()
            if not self._announced:  # offered to no one (an empty shard): nobody takes the pin
                self._close_pin()

    def stopped(self, exc: BaseException) -> None:
        """This attempt failed with ``exc`` and nothing was published. A reader that claimed
        the file waits for the cache's outcome (:meth:`resumed` or :meth:`failed`); an
        unclaimed file can no longer be claimed."""
        with self._cond:
            if self._error is not None or self._stopped or self._size is not None:
                return
            if not self.claimed:
                self._fail(exc)
                return
            self._stopped = True
            self._kept_fd = os.dup(self._fd)  # the writer's descriptor closes on return

    def waits_for_resume(self) -> bool:
        """Whether a reader follows this stopped attempt (:meth:`resumed` is then due)."""
        with self._cond:
            return self._stopped

    def resumed(self, pin_fd: int) -> None:
        """The shard was published after this attempt stopped: ``pin_fd`` (owned from now
        on) is the published file, pinned. Compares the bytes this attempt wrote with it;
        the reader goes on in it from the first difference, or fails if it was already
        given a byte that differs."""
        with self._cond:
            kept, self._kept_fd = self._kept_fd, None
            if not self._stopped or self._error is not None or kept is None:
                os.close(pin_fd)
                if kept is not None:
                    os.close(kept)
                return
        try:
            same = _common_prefix(kept, pin_fd, self._watermark)
            size = os.fstat(pin_fd).st_size
        except BaseException:
            os.close(pin_fd)
            raise
        finally:
            os.close(kept)
        with self._cond:
            self._stopped = False
            if same < self._handed:
                os.close(pin_fd)
                self._fail(
                    IntegrityError(
                        f"{self.url}: the download this reader was following stopped, and the "
                        f"shard fetched again differs from it at byte {same}, after the reader "
                        f"had consumed {self._handed} bytes: the samples already read came "
                        "from bytes that were not verified and may be wrong. The shard is "
                        "cached verified; read it again, or set "
                        "SHARDCACHE_READ_WHILE_DOWNLOADING=off to read only verified shards.",
                        url=self.url,
                        expected="the first bytes of the published shard",
                        seen=f"a difference at byte {same} after {self._handed} bytes were read",
                    )
                )
                return
            self._watermark = same
            self._resumed_fd = pin_fd
            self._size = size
            self._cond.notify_all()

    def failed(self, exc: BaseException) -> None:
        """The fetch failed with ``exc``: nothing was published (a no-op once it was)."""
        with self._cond:
            if self._size is None:
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Record ``exc`` as the outcome; called with the condition held."""
        if self._error is None:
            self._error = exc
        self._stopped = False
        if self._kept_fd is not None:
            os.close(self._kept_fd)
            self._kept_fd = None
        self._cond.notify_all()
        if not self.claimed:
            self._close_pin()

    def detach_pin(self) -> int | None:
        """For the cache once the download is published: the pin's descriptor if no reader
        claimed this file (the caller now owns it), else None (the reader holds the pin)."""
        with self._cond:
            if self.claimed:
                return None
            self._detached = True
            fd, self._pin_fd = self._pin_fd, None
            return fd

    def _close_pin(self) -> None:
        fd, self._pin_fd = self._pin_fd, None
        if fd is not None:
            os.close(fd)

    # -- the reading side ------------------------------------------------------------

    def claim(self) -> bool:
        """Take this file for reading; False once the download is over (then the caller
        gets the published file, or the error, the usual way)."""
        with self._cond:
            if self.claimed or self._detached or self._error is not None or self._stopped:
                return False
            self.claimed = True
            return True

    def open(
        self, until_stall: UntilStall, on_close: Callable[[], None] | None = None
    ) -> io.BufferedReader:
        """A buffered reader of the claimed file; ``until_stall`` bounds each wait."""
        assert self.claimed, "claim() the file first"
        return io.BufferedReader(GrowingReader(self, until_stall, on_close), 1 << 20)

    def _take_pin(self) -> int:
        with self._cond:
            fd, self._pin_fd = self._pin_fd, None
        if fd is None:
            raise FetchError(
                f"{self.url}: the download stopped before it could be read",
                url=self.url,
                attempts=1,
                cause="download stopped",
            )
        return fd

    def verdict(self, until_stall: UntilStall) -> ShardCacheError | None:
        """Wait until the download was published (None) or failed: then its error, unless a
        reader already raised it (None). For a consumer done reading before the end of
        the file (a tar reader stops at the end-of-archive blocks)."""
        while True:
            timeout = until_stall()
            with self._cond:
                if self._error is not None:
                    if self._reported:
                        return None
                    self._reported = True
                    return _reader_error(self.url, self._error)
                if self._size is not None:
                    return None
                _wait_for_data(self._cond, timeout)

    def _available(self, pos: int, want: int, timeout: float) -> int:
        """Bytes readable at ``pos`` (at most ``want``), waiting at most ``timeout``
        seconds for some; 0 at the end of the verified file, -1 if none came in time,
        :data:`_SWITCH` when the rest is to be read from :meth:`_take_resumed`'s file."""
        with self._cond:
            for waited in (False, True):
                if self._error is not None:
                    self._reported = True
                    raise _reader_error(self.url, self._error)
                if pos < self._watermark:
                    count = min(want, self._watermark - pos)
                    self._handed = max(self._handed, pos + count)
                    return count
                if self._resumed_fd is not None:
                    return _SWITCH
                if self._size is not None:
                    return 0
                if not waited:
                    _wait_for_data(self._cond, timeout)
            return -1

    def _take_resumed(self) -> int:
        with self._cond:
            fd, self._resumed_fd = self._resumed_fd, None
        assert fd is not None
        return fd

    def _drop_resumed(self) -> None:
        """The reader closed: a published file it did not go on in is let go."""
        with self._cond:
            fd, self._resumed_fd = self._resumed_fd, None
        if fd is not None:
            os.close(fd)


class GrowingWriter:
    """The ``out`` of a download that may be read early: unbuffered, every write reported
    to its :class:`GrowingFile` once it is in the file (so the watermark never runs ahead
    of the bytes). Supports what the strategies use: write, seek, tell, truncate, flush,
    fileno."""

    def __init__(self, fd: int, growing: GrowingFile) -> None:
        self._fd = fd
        self._growing = growing
        self._pos = 0

    def write(self, data: BytesLike) -> int:
        view = memoryview(data).cast("B")
        start = self._pos
        total = len(view)
        while view:
            written = os.pwrite(self._fd, view, self._pos)
            view = view[written:]
            self._pos += written
        self._growing.wrote(start, total)
        return total

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            self._pos = offset
        elif whence == os.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = os.fstat(self._fd).st_size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        os.ftruncate(self._fd, size)
        self._growing.truncated(size)
        return size

    def flush(self) -> None:
        return None

    def fileno(self) -> int:
        return self._fd

    def __enter__(self) -> GrowingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class GrowingReader(io.RawIOBase):
    """Reads a :class:`GrowingFile` (from byte 0, or where it seeks to): blocks for bytes
    not yet written, ends only at the end of the verified file, raises the download's error.
    Its descriptor pins the shard until closed."""

    def __init__(
        self,
        growing: GrowingFile,
        until_stall: UntilStall,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._growing = growing
        self._until_stall = until_stall
        self._on_close = on_close
        self._fd = growing._take_pin()
        self._pos = 0
        self._settled = False  # reading the published file (after a resume): no waits

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move the read position; a read there waits for its bytes as any read does.
        Not from the end: that is not known before the download is over."""
        if whence == os.SEEK_SET:
            position = offset
        elif whence == os.SEEK_CUR:
            position = self._pos + offset
        else:
            raise io.UnsupportedOperation(
                f"{self._growing.url}: cannot seek from the end of a shard still downloading"
            )
        if position < 0:
            raise ValueError(f"negative seek position {position}")
        self._pos = position
        return position

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: BytesLike) -> int:
        view = memoryview(buffer).cast("B")
        if not view:
            return 0
        count = len(view)
        while not self._settled:
            count = self._growing._available(self._pos, len(view), self._until_stall())
            if count == _SWITCH:
                os.close(self._fd)  # the stopped attempt's file; its bytes were compared
                self._fd = self._growing._take_resumed()
                self._settled = True
                count = len(view)
            elif count >= 0:
                break
        if count == 0:
            return 0
        got = os.preadv(self._fd, [view[:count]], self._pos)
        self._pos += got
        return got

    def close(self) -> None:
        if self.closed:
            return
        try:
            os.close(self._fd)
            self._growing._drop_resumed()
        finally:
            super().close()
            if self._on_close is not None:
                self._on_close()


_SWITCH = -2
"""From :meth:`GrowingFile._available`: go on in the published file."""
_COMPARE_BLOCK = 1 << 20


def _wait_for_data(cond: threading.Condition, timeout: float) -> None:
    """The reader waits for bytes still downloading: counted as the consumer's wait for
    data in the loader metrics."""
    start = time.monotonic()
    cond.wait(timeout)
    metrics.collector().waited_for_data(time.monotonic() - start)


def _common_prefix(a: int, b: int, limit: int) -> int:
    """How many of the first ``limit`` bytes of files ``a`` and ``b`` are the same."""
    offset = 0
    while offset < limit:
        want = min(_COMPARE_BLOCK, limit - offset)
        left, right = os.pread(a, want, offset), os.pread(b, want, offset)
        if left != right or len(left) < want:
            same = next(
                (i for i, (x, y) in enumerate(zip(left, right, strict=False)) if x != y),
                min(len(left), len(right)),
            )
            return offset + same
        offset += want
    return limit


def _reader_error(url: str, error: BaseException) -> ShardCacheError:
    """What a reader raises for the download's failure: the cache's own error as it is,
    anything else (a cancelled download, a local I/O error) as :class:`FetchError`."""
    if isinstance(error, ShardCacheError):
        return error
    cause = f"{type(error).__name__}: {error}"
    failure = FetchError(
        f"{url}: the download this reader was following stopped ({cause}); nothing was "
        "published. Fetch the shard again.",
        url=url,
        attempts=1,
        cause=cause,
    )
    failure.__cause__ = error
    return failure
