"""The parallel ranged download of a large S3 object.

Up to ``max_parts_in_flight`` concurrent ranged GETs of ``part_size`` bytes, each written
at its offset into the same temp file (``os.pwrite``), each retried on its own, all
guarded by ``If-Match`` on the ETag (a change shows as HTTP 412: :class:`IntegrityError`).
Memory stays bounded by parts in flight x a 1 MiB read piece. The size is checked per
part. The object's S3 checksum, when it is a CRC (CRC64NVME, CRC32C, CRC32: what S3 keeps of
new objects), is computed per part as the bytes arrive and the parts' CRCs are combined: no
byte is read twice. So is the CRC32C every download records (``mesh_crc32c``). An
algorithm that does not combine (the MD5 of a single-part ETag, SHA) is computed in order
by a :class:`~shardcache._transfer.hash_follower.HashFollower` from the file (still in the
page cache) while the parts arrive, so only the tail is left once the last part lands. A
failed verification downloads the object again with fresh metadata, as a single stream if
it is no longer large.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import BinaryIO

from .._base.errors import IntegrityError
from .._base.redact import get_logger
from .._base.url_kinds import url_protocol
from .._observe import metrics
from .._retry.policy import (
    TruncatedBody,
    describe,
    is_transient,
    retry_cause,
)
from .checksums import MESH_CRC, Hasher, combinable
from .download import (
    Expected,
    LocalWriteError,
    ObjectInfo,
    OpenedObject,
    Progress,
    Source,
    Strategy,
    changed_underneath,
    local_io,
    precondition_failed,
    s3_body,
    verification_failed,
)
from .hash_follower import HashFollower, PartsWritten
from .multipart import PartsHasher, composite_value

logger = get_logger(__name__)

_PART_PIECE = 1 << 20  # bytes read from a part's body at a time (bounds memory per part)
_PROGRESS_EVERY = 0.1  # seconds between progress reports of a parallel download


class _PartsCancelled(Exception):
    """A sibling part failed (or the caller stopped): stop this part quietly."""


class ParallelDownload(Strategy):
    """Large S3 objects, in parts fetched concurrently; ``fallback`` takes an object that
    turned out small on a second look."""

    def __init__(self, source: Source, fallback: Strategy) -> None:
        super().__init__(source)
        self.fallback = fallback

    def suits(self, info: ObjectInfo, out: BinaryIO) -> bool:
        """Whether ``info`` is an S3 object large enough and ``out`` a real file."""
        opts = self.options
        if url_protocol(info.url) not in {"s3", "s3a"} or opts.max_parts_in_flight < 2:
            return False
        if info.size is None or info.size < max(opts.parallel_threshold, 2 * opts.part_size):
            return False
        try:
            out.fileno()
        except (AttributeError, OSError, ValueError):
            return False
        return True

    def download(
        self,
        info: ObjectInfo,
        out: BinaryIO,
        progress: Progress,
        opened: OpenedObject | None = None,
    ) -> ObjectInfo:
        first = opened.take(_piece(self.options.chunk_size)) if opened is not None else None

        def attempt(n: int) -> ObjectInfo | None:
            nonlocal first
            if n > 1 and not self.suits(info, out):
                return None  # fresh metadata says the object is no longer large
            head, first = first, None
            expected = self.expectation(info)
            plan = _Plan(expected, info.size or 0, self.options.part_size)
            digest, parts = self._fetch_parts(info, out, progress, n, head=head, plan=plan)
            verified = self.verify(
                info, info.size, digest, n, expected=expected, out=out, part_digests=parts
            )
            out.seek(info.size)
            return replace(verified, mesh_crc32c=plan.crc32c())

        def on_retry(exc: Exception, n: int) -> None:
            nonlocal info
            metrics.retried(retry_cause(exc))
            info = self.start_over(info.url, out)

        done = self.options.retry.run(
            attempt, retry_if=verification_failed, give_up=lambda exc, n: exc, on_retry=on_retry
        )
        return self.fallback.download(info, out, progress) if done is None else done

    def _fetch_parts(
        self,
        info: ObjectInfo,
        out: BinaryIO,
        progress: Progress,
        attempt: int,
        *,
        head: Iterator[bytes] | None,
        plan: _Plan,
    ) -> tuple[str | None, list[bytes] | None]:
        """Every part at its offset; ``head``, the body of a whole-object GET already
        answered, gives the first part (then is closed) instead of a ranged GET of its own.
        Returns the checksum of the object's bytes under ``plan`` (None: none asked)
        and, for a multipart upload's, each upload part's digest."""
        size = info.size or 0
        with local_io():
            out.flush()
            fd = out.fileno()
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # parts land at their offsets in any order
        ranges, hashers = plan.ranges, plan.hashers
        done = PartsWritten(ranges)
        cancel = threading.Event()
        landed = False
        progress(phase=self.phase(attempt), bytes_done=0, bytes_total=size)  # may cancel
        pool = cf.ThreadPoolExecutor(
            max_workers=min(len(ranges), self.options.max_parts_in_flight),
            thread_name_prefix="shardcache-part",
        )
        follower = None
        try:
            if plan.follow is not None:  # started here: always stopped below
                follower = HashFollower(fd, size, plan.follow, done)
            futures = [
                pool.submit(
                    self._fetch_part,
                    info,
                    fd,
                    span,
                    done,
                    cancel,
                    part_number=i,
                    head=head if i == 0 else None,
                    hasher=hashers[i],
                    crc=plan.crcs[i],
                )
                for i, span in enumerate(ranges)
            ]
            pending = set(futures)
            reported = -1
            while pending:
                finished, pending = cf.wait(
                    pending, timeout=_PROGRESS_EVERY, return_when=cf.FIRST_EXCEPTION
                )
                for future in finished:
                    future.result()  # re-raises the part's error here
                if done.value != reported:
                    reported = done.value
                    progress(phase="downloading", bytes_done=reported, bytes_total=size)
            landed = True
        finally:
            cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
            if follower is not None and not landed:
                follower.abandon()
        try:
            if done.value != size:  # every part checks its own length; belt and braces
                raise IntegrityError(
                    f"{info.url}: parallel download wrote {done.value} bytes, expected {size}",
                    url=info.url,
                    attempts=attempt,
                    expected=size,
                    seen=done.value,
                )
            if follower is not None:
                progress(phase="verifying", bytes_done=size, bytes_total=size)
                # The tail after the last part: the rest is hashed.
                return follower.digest(), plan.part_digests()
        except BaseException:
            if follower is not None:
                follower.abandon()  # never left waiting for bytes that will not come
            raise
        return plan.digest(), plan.part_digests()

    def _fetch_part(
        self,
        info: ObjectInfo,
        fd: int,
        span: tuple[int, int],
        done: PartsWritten,
        cancel: threading.Event,
        *,
        part_number: int,
        head: Iterator[bytes] | None = None,
        hasher: Hasher | None = None,
        crc: Hasher,
    ) -> None:
        """Write bytes ``[start, end)`` of the object at their offset; resumes and retries.
        ``head``: the object's body from byte 0, read for the first attempt up to ``end``;
        ``hasher`` and ``crc`` (the range's CRC32C): updated with every byte written, in
        order (a resumed attempt goes on from the byte the last one reached)."""
        pos, end = span

        def attempt(n: int) -> None:
            nonlocal pos, head
            if cancel.is_set():
                raise _PartsCancelled
            given, head = head, None
            pieces = self._range(info, pos, end) if given is None else _upto(given, end)
            for chunk in pieces:
                if cancel.is_set():
                    raise _PartsCancelled
                if len(chunk) > end - pos:
                    raise IntegrityError(
                        f"{info.url}: the store sent more than the requested range "
                        f"bytes={pos}-{end - 1}; nothing was published.",
                        url=info.url,
                        attempts=n,
                        expected=end - pos,
                        seen=len(chunk),
                    )
                view = memoryview(chunk)
                while view:
                    with local_io():
                        written = os.pwrite(fd, view, pos)
                    view = view[written:]
                    pos += written
                    done.add(part_number, pos, written)
                if hasher is not None:
                    hasher.update(chunk)
                crc.update(chunk)
            if pos < end:
                raise TruncatedBody(f"part body ended at byte {pos}, expected {end}")

        def give_up(exc: Exception, n: int) -> BaseException:
            if isinstance(exc, _NOT_REMOTE):
                return exc
            if precondition_failed(exc):
                return changed_underneath(info, n)
            return self.source.fetch_error(info.url, n, exc)

        def wait(seconds: float) -> None:
            if cancel.wait(seconds):
                raise _PartsCancelled

        self.options.retry.run(
            attempt,
            retry_if=lambda exc: (
                not isinstance(exc, _NOT_REMOTE)
                and not precondition_failed(exc)
                and is_transient(exc)
            ),
            give_up=give_up,
            on_retry=lambda exc, n: _part_retry(info.url, exc, n),
            wait=wait,
        )

    def _range(self, info: ObjectInfo, start: int, end: int) -> Iterator[bytes]:
        """One ranged GET of bytes ``[start, end)``."""
        fs, path = self.source.filesystem(info.url)
        piece = _piece(self.options.chunk_size)
        return s3_body(fs, path, info, piece, self.options.throttle, start=start, end=end)


class _Plan:
    """The ranges of one download and how its checksum is computed:

    * a CRC of the bytes: each range's CRC as its bytes pass, combined;
    * a multipart upload's checksum, its parts at most twice ``part_size``: one range per
      upload part, each hashed as its bytes pass (MD5s on as many threads as parts in
      flight), the digests joined;
    * MD5 or SHA of the bytes, or a multipart checksum of larger parts: ranges of
      ``part_size``, hashed in order by a follower thread (``follow``)."""

    def __init__(self, expected: Expected, size: int, part: int) -> None:
        want, layout = expected.checksum, expected.layout
        self._algorithm = want.algorithm if want is not None else None
        self._layout = layout
        self.follow: Hasher | PartsHasher | None = None
        if layout is not None and max(layout.sizes) <= 2 * part:
            self.ranges = layout.spans()
        else:
            self.ranges = [(start, min(start + part, size)) for start in range(0, size, part)]
        inline = self._algorithm is not None and (
            (layout is not None and self.ranges == layout.spans())
            or (layout is None and combinable(self._algorithm))
        )
        self.hashers = [
            Hasher(self._algorithm) if inline and self._algorithm else None for _ in self.ranges
        ]
        if self._algorithm is not None and not inline:
            self.follow = expected.hasher()
        self.crcs = [Hasher(MESH_CRC) for _ in self.ranges]  # each range's, combined below

    def crc32c(self) -> str:
        """The CRC32C of the object's bytes (``mesh_crc32c``), once every range landed."""
        return _combined(self.crcs, self.ranges)

    def part_digests(self) -> list[bytes] | None:
        """Each upload part's digest, for a multipart upload's checksum (else None)."""
        if self._layout is None:
            return None
        if isinstance(self.follow, PartsHasher):
            return self.follow.digests
        return [h.digest() for h in self.hashers if h is not None]

    def digest(self) -> str | None:
        """The checksum once every range landed (a follower's is taken by the caller)."""
        hashers = [h for h in self.hashers if h is not None]
        if self._algorithm is None or not hashers:
            return None
        if self._layout is not None:
            return composite_value(self._algorithm, [h.digest() for h in hashers])
        return _combined(hashers, self.ranges)


def _combined(hashers: list[Hasher], ranges: list[tuple[int, int]]) -> str:
    """The CRC of the ranges' bytes in order, from each range's ``hashers`` (the first
    becomes the whole's)."""
    total = hashers[0]
    for hasher, (start, end) in zip(hashers[1:], ranges[1:], strict=True):
        total.extend(hasher, end - start)
    return total.value()


def _piece(chunk_size: int) -> int:
    return min(chunk_size, _PART_PIECE)


def _upto(body: Iterator[bytes], end: int) -> Iterator[bytes]:
    """The first ``end`` bytes of ``body`` (a whole-object GET's pieces), then the body is
    closed (its connection dropped with the rest unread: the other parts have their own)."""
    got = 0
    try:
        for data in body:
            if got + len(data) >= end:
                yield data[: end - got]
                return
            got += len(data)
            yield data
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()


def _part_retry(url: str, exc: Exception, n: int) -> None:
    metrics.retried(retry_cause(exc))
    logger.info("retrying a part of %s after %s (attempt %d)", url, describe(exc), n)


# Failures that are not the store's answer for this part: passed on as they are.
_NOT_REMOTE = (_PartsCancelled, LocalWriteError, IntegrityError)
