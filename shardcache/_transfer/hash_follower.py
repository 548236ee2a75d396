"""Hashing a parallel download in order while its parts still arrive.

A checksum that does not combine across pieces (MD5, SHA) must see the object's bytes in
order, but a parallel download writes its parts in any order. :class:`PartsWritten` tracks
how far each part got and so the contiguous prefix written from byte 0; a
:class:`HashFollower` thread hashes that prefix from the file (still in the page cache) as it
grows, so that when the last part lands only its tail is left to hash, not the whole object.

Invariants: a byte is hashed once, in order, and only once every byte before it is
written; a part's bytes below the position it reported are final (a retried part resumes
from there, it never rewrites them).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from .checksums import Hasher
from .download import local_io
from .multipart import PartsHasher

_BLOCK = 8 << 20  # bytes read back from the file at a time (one reused buffer)
_POLL = 0.5  # seconds between looks at ``stop`` while nothing new was written


class PartsWritten:
    """How far each part of a download got, and how many bytes were written in all."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.value = 0  # bytes written in all (progress reports)
        self._reached = [start for start, _ in ranges]
        self._ends = [end for _, end in ranges]
        self._cond = threading.Condition()

    def add(self, part: int, reached: int, n: int) -> None:
        """Part number ``part`` wrote ``n`` more bytes and now reaches byte ``reached``."""
        with self._cond:
            self.value += n
            self._reached[part] = reached
            self._cond.notify_all()

    def _prefix(self) -> int:
        for reached, end in zip(self._reached, self._ends, strict=True):
            if reached < end:
                return reached
        return self._ends[-1] if self._ends else 0

    def wait_past(self, offset: int, stop: threading.Event) -> int:
        """The contiguous prefix's end, once it is past ``offset`` (or ``stop`` is set)."""
        with self._cond:
            while (prefix := self._prefix()) <= offset and not stop.is_set():
                self._cond.wait(_POLL)
            return prefix


class HashFollower:
    """A thread feeding the first ``size`` bytes of ``fd`` to ``hasher`` in order as
    ``written`` allows (a :class:`~shardcache._transfer.checksums.Hasher`, or a multipart
    upload's :class:`~shardcache._transfer.multipart.PartsHasher`)."""

    def __init__(
        self, fd: int, size: int, hasher: Hasher | PartsHasher, written: PartsWritten
    ) -> None:
        self._fd, self._size, self._written = fd, size, written
        self._hasher = hasher
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shardcache-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            buf = memoryview(bytearray(min(_BLOCK, max(self._size, 1))))
            done = 0
            while done < self._size and not self._stop.is_set():
                upto = self._written.wait_past(done, self._stop)
                while done < upto:
                    with local_io():
                        n = os.preadv(self._fd, [buf[: min(len(buf), upto - done)]], done)
                    if n <= 0:
                        raise OSError(f"the download file ended at byte {done} of {upto}")
                    self._hasher.update(buf[:n])
                    done += n
        except BaseException as exc:  # handed to the caller by digest()
            self._error = exc

    def digest(self) -> str:
        """Wait for the rest to be hashed (every part has landed) and return the checksum;
        re-raises the thread's error."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hasher.value()

    def abandon(self) -> None:
        """Stop at once (the download failed) and wait for the thread."""
        self._stop.set()
        self._thread.join()
