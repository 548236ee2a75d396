"""What every download strategy shares: the object's description, the options, the
:class:`Strategy` interface and its common steps (verification, restarting the file).

A strategy writes one object into the caller's file and verifies it, retrying under the options'
:class:`~shardcache._retry.policy.RetryPolicy`. :class:`~shardcache._transfer.remote.Remote` picks
one per object: :mod:`~shardcache._transfer.stream_download` (one GET, or a sequential read),
:mod:`~shardcache._transfer.parallel_download` (concurrent ranged GETs of a large S3 object) or
:mod:`~shardcache._transfer.pipe_download` (a ``pipe:`` command's output).

A failure to write the caller's file is never the store's fault: it is marked
:class:`LocalWriteError` (never retried or classified) and the caller gets the ``OSError``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, BinaryIO, Protocol

from fsspec.asyn import sync

from .._base.errors import FetchError, IntegrityError, UnverifiableError
from .._base.redact import get_logger, redact_options
from .._base.url_kinds import LOCAL_PROTOCOLS, s3_version, url_protocol
from .._retry.policy import RetryPolicy, _http_status_and_code
from .._retry.throttle import Throttle, throttled_call
from .checksums import Checksum, Hasher, expected, mismatch
from .multipart import PartLayout, PartsHasher, differing_parts, rehash

logger = get_logger(__name__)


class Progress(Protocol):
    """Observer of one download (the lock heartbeat, the watchdog and progress bars)."""

    def __call__(self, *, phase: str, bytes_done: int, bytes_total: int | None) -> None: ...


REQUESTING = "requesting"
"""The phase a fetch reports while its request waits for an answer (the prefetcher's first
shard holds the read-ahead back until the phase moves on)."""


def no_progress(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
    return None


@dataclass(frozen=True)
class ObjectInfo:
    """What we know of a remote object before downloading it."""

    url: str
    size: int | None  # None: known only once downloaded (a pipe: command's output)
    etag: str | None = None
    version_id: str | None = None
    # An MD5 the store promises: the ETag where S3 promises it is one (single-part: the
    # content's; a multipart upload's: of its parts' MD5s, ``parts`` set), GCS's md5Hash,
    # Azure's Content-MD5.
    md5_checksum: Checksum | None = None
    mtime_ns: int | None = None  # a local source's modification time (its version)
    checksum: Checksum | None = None  # the store's own checksum (S3: x-amz-checksum-*)
    verified: Checksum | None = None  # set on the info a download returns: what it checked
    parts_layout: PartLayout | None = None  # with ``verified``: the parts it was checked in
    # Set on the info a download returns: the CRC32C of the bytes written (base64, as S3's),
    # hashed as they landed; what peers of the cache mesh check this copy against.
    mesh_crc32c: str | None = None

    @property
    def md5(self) -> str | None:
        """The hex MD5 of the content, when the store gives one (not of a multipart upload's
        parts)."""
        c = self.md5_checksum
        return c.value if c is not None and c.parts is None else None

    def expected_checksum(self, verify: str) -> Checksum | None:
        """What a download is checked against beyond the size (see
        :func:`shardcache._transfer.checksums.expected`)."""
        return expected(self, verify)


@dataclass(frozen=True)
class Expected:
    """What one download is checked against: a checksum (None: the size only) and, for a
    multipart upload's checksum, the parts' layout it is computed over."""

    checksum: Checksum | None = None
    layout: PartLayout | None = None

    def hasher(self) -> Hasher | PartsHasher | None:
        """A running checksum of the object's bytes fed in order."""
        if self.checksum is None:
            return None
        if self.layout is None:
            return Hasher(self.checksum.algorithm)
        return PartsHasher(self.checksum.algorithm, self.layout)


@dataclass(frozen=True, repr=False)
class RemoteOptions:
    """How to reach remote stores and how hard to try (``repr``: credentials redacted)."""

    # No defaults here: every value comes from the resolved settings (their specs).
    storage_options: dict[str, Any] = field(repr=False)  # may hold credentials
    retry: RetryPolicy
    io_timeout: float
    chunk_size: int
    verify: str  # "etag", "size" or "strict"
    etag_md5: str  # "auto": an S3 ETag is an MD5 where S3 promises it; "off": never
    parallel_threshold: int  # S3 objects at least this big use parallel ranged GETs
    part_size: int
    max_parts_in_flight: int  # concurrent ranged GETs per download; 1 disables them
    max_connections: int  # connections one store's client may keep open at once
    throttle: Throttle  # the process's request slots (shared by every thread; see _throttle)

    def __repr__(self) -> str:
        rest = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"RemoteOptions(storage_options={redact_options(self.storage_options)!r}, {rest})"


class OpenedObject:
    """An object whose GET is answered: its info, read from the response's headers, and its
    body, not read yet. The download reads that body instead of sending a request of its own,
    so a cold shard costs one request (see :meth:`shardcache._transfer.remote.Remote.open`).

    Stores other than S3 have no such response: ``body`` is None and the download sends its
    own request. :meth:`close` ends a response that was not read to its end."""

    def __init__(self, info: ObjectInfo, fs: Any = None, body: Any = None) -> None:
        self.info = info
        self._fs = fs
        self._body = body
        self._taken = False

    def take(self, piece: int) -> Iterator[bytes] | None:
        """The body from byte 0 in pieces of at most ``piece`` bytes, once: a later attempt
        (a retry, a second download after a full disk) sends its own request."""
        if self._body is None or self._taken:
            return None
        self._taken = True
        return read_body(self._fs, self._body, piece)

    def close(self) -> None:
        if self._body is not None:
            self._body.close()

    def __enter__(self) -> OpenedObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Source(Protocol):
    """What a strategy needs of the remote: its options, file systems and fresh metadata."""

    options: RemoteOptions

    def filesystem(self, url: str) -> tuple[Any, str]: ...

    def info(self, url: str) -> ObjectInfo: ...

    def part_layout(self, info: ObjectInfo, parts: int, *, exact: bool) -> PartLayout | None: ...

    def part_checksums(self, info: ObjectInfo, algorithm: str, parts: int) -> list[str] | None: ...

    def fetch_error(
        self, url: str, attempts: int, exc: BaseException, what: str = "download"
    ) -> FetchError: ...


class LocalWriteError(Exception):
    """Local file I/O failed (the ``OSError`` is ``__cause__``): not a remote error, never
    retried or classified; :meth:`Remote.download` re-raises the ``OSError`` itself."""


@contextlib.contextmanager
def local_io() -> Iterator[None]:
    """Mark writes to the caller's file: a full disk (ENOSPC, EDQUOT), a read-only or
    failing file system (EROFS, EIO) is the cache's problem, not the store's."""
    try:
        yield
    except OSError as exc:
        raise LocalWriteError(str(exc)) from exc


def restart(out: BinaryIO) -> None:
    """Empty the caller's file for a download from byte 0."""
    with local_io():
        out.seek(0)
        out.truncate()


def verification_failed(exc: BaseException) -> bool:
    """Whether a failed attempt calls for :meth:`Strategy.start_over` (the bytes were
    corrupted in transit, or the object changed underneath)."""
    return isinstance(exc, IntegrityError)


class Strategy(abc.ABC):
    """One way to download an object into the caller's file and verify it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.options = source.options

    @staticmethod
    def phase(attempt: int, first: str = "downloading") -> str:
        """The progress phase of attempt number ``attempt``: ``first``, then "retry N"."""
        return first if attempt == 1 else f"retry {attempt - 1}"

    def start_over(self, url: str, out: BinaryIO) -> ObjectInfo:
        """After a failed verification: fresh metadata (a replaced object has a new size
        and ETag) and an empty file, for a download from byte 0."""
        logger.warning("%s failed verification; downloading it again", url)
        info = self.source.info(url)
        restart(out)
        return info

    @abc.abstractmethod
    def download(
        self,
        info: ObjectInfo,
        out: BinaryIO,
        progress: Progress,
        opened: OpenedObject | None = None,
    ) -> ObjectInfo:
        """Write ``info.url`` into ``out`` (positioned at 0, left at the end) and verify it;
        returns the info the bytes were verified against. ``opened``: the object's GET,
        already answered, whose body the first attempt reads instead of sending a request.
        Raises a :class:`~shardcache.FetchError` subclass or :class:`IntegrityError`, or
        :class:`LocalWriteError` for a failed write of ``out``."""

    def expectation(self, info: ObjectInfo) -> Expected:
        """What a download of ``info`` is checked against: the store's cheapest checksum
        (:func:`~shardcache._transfer.checksums.expected`) with, for a multipart upload's,
        the parts' layout asked of the store. A store that describes no layout leaves the
        size only (logged)."""
        want = info.expected_checksum(self.options.verify)
        if want is not None and want.parts is not None:
            layout = self.source.part_layout(info, want.parts, exact=False)
            if layout is not None:
                return Expected(want, layout)
            logger.warning(
                "%s: the store does not describe the %d parts of its upload, so its %s "
                "cannot be checked; verified by size only",
                info.url,
                want.parts,
                want.source,
            )
            want = None
        if want is None and self.options.verify == "strict" and not _local(info.url):
            raise UnverifiableError(
                f"{info.url}: the store describes this object by its size only (no checksum, "
                "no MD5 ETag, no layout of its parts), and SHARDCACHE_VERIFY=strict refuses "
                "to publish what it cannot check; nothing was downloaded. Upload it with a "
                "checksum (e.g. aws s3 cp --checksum-algorithm CRC64NVME), or set "
                "SHARDCACHE_VERIFY=etag to accept a size check for such objects.",
                url=info.url,
                attempts=1,
                cause="size only",
            )
        return Expected(want)

    def verify(
        self,
        info: ObjectInfo,
        size: int,
        digest: str | None,
        attempt: int,
        *,
        expected: Expected,
        out: BinaryIO | None = None,
        part_digests: list[bytes] | None = None,
    ) -> ObjectInfo:
        """Raise :class:`IntegrityError` unless ``size`` and ``digest`` (the downloaded
        bytes' checksum under ``expected``; None when it names none) match the object's.
        A multipart checksum computed over an assumed regular layout that does not match
        is computed again from ``out`` over the layout asked part by part, when that one
        differs; one that does not match names the parts that differ where the store
        reports each part's checksum (``part_digests``: ours). Returns ``info`` with
        ``verified`` (None: the size only) and ``parts_layout`` set."""
        if size != info.size:
            raise IntegrityError(
                f"{info.url}: downloaded {size} bytes, expected {info.size} on attempt "
                f"{attempt} (the object changed during the download, or the store misreports "
                "its size); nothing was published. Check the object, then fetch again.",
                url=info.url,
                attempts=attempt,
                expected=info.size,
                seen=size,
            )
        want, layout = expected.checksum, expected.layout
        if want is not None and digest != want.value and layout is not None and layout.assumed:
            exact = self.source.part_layout(info, len(layout.sizes), exact=True)
            if exact is not None and exact.sizes != layout.sizes and out is not None:
                logger.info("%s: its upload's parts are not of one size; hashing again", info.url)
                with local_io():
                    hashed = rehash(out, want.algorithm, exact)
                digest, layout, part_digests = hashed.value(), exact, hashed.digests
        if want is not None and digest != want.value:
            which, parts = self._which_parts(info, want, layout, part_digests)
            raise mismatch(info.url, want, digest, attempt, which=which, parts=parts)
        return replace(info, verified=want, parts_layout=layout if want is not None else None)

    def _which_parts(
        self,
        info: ObjectInfo,
        want: Checksum,
        layout: PartLayout | None,
        ours: list[bytes] | None,
    ) -> tuple[str, list[int]]:
        """Which parts of a multipart upload differ from the store's, said for a message,
        and their numbers (none known: empty)."""
        if want.parts is None:
            return "", []
        if want.algorithm == "md5":
            return "the store keeps no MD5 of each part, so which one differs is not known", []
        if layout is None or ours is None or len(ours) != want.parts:
            return "which part differs is not known", []
        theirs = self.source.part_checksums(info, want.algorithm, want.parts)
        return differing_parts(want.algorithm, layout, ours, theirs)


def _local(url: str) -> bool:
    """Whether ``url`` is a file on this machine: its copy crosses no network."""
    return url_protocol(url) in LOCAL_PROTOCOLS


def s3_get(
    fs: Any,
    path: str,
    info: ObjectInfo,
    throttle: Throttle,
    *,
    start: int = 0,
    end: int | None = None,
) -> Any:
    """Send one GET of bytes ``[start, end)`` of an S3 object (the whole object when neither
    is given) in a slot of ``throttle``; returns the response once its headers arrived, its
    ``Body`` unread. A ranged GET carries ``If-Match`` on the ETag, so a changed object is
    never stitched together (HTTP 412 instead: :func:`changed_underneath`), and so does a
    whole-object GET of an object whose ETag is known (a download started again from byte
    0). A whole-object GET asks for the object's full-object checksum
    (``x-amz-checksum-mode``: see :func:`ask_for_checksums`)."""
    bucket, key, version = fs.split_path(path)
    version = version or s3_version(path) or info.version_id
    kw: dict[str, Any] = {}
    if version:
        kw["VersionId"] = version
    if start or end is not None:
        kw["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    if info.etag:  # a resumed, ranged or repeated GET: never another object's bytes
        kw["IfMatch"] = f'"{info.etag}"'
    return throttled_call(
        throttle,
        "GET",
        lambda: sync(fs.loop, fs._call_s3, "get_object", Bucket=bucket, Key=key, **kw),
    )


def precondition_failed(exc: BaseException) -> bool:
    """HTTP 412: the If-Match on the ETag failed, so the object changed."""
    return any(
        item is not None and _http_status_and_code(item)[0] == 412
        for item in (exc, exc.__cause__, exc.__context__)
    )


def changed_underneath(
    info: ObjectInfo,
    attempt: int | None = None,
    *,
    noticed: str | None = None,
    expected: str | None = None,
    seen: str = "another version",
) -> IntegrityError:
    """The error of a download whose object was replaced meanwhile: a failed verification,
    so the download starts over on the new object. ``noticed`` says how (default S3's: HTTP
    412, the If-Match on the ETag failed), ``expected`` the version read (default the
    ETag) and ``seen`` what was found instead."""
    noticed = noticed or f"If-Match on ETag {info.etag} failed"
    return IntegrityError(
        f"{info.url} changed during the download ({noticed}); nothing was published.",
        url=info.url,
        **({} if attempt is None else {"attempts": attempt}),
        expected=expected or info.etag,
        seen=seen,
    )


def s3_body(
    fs: Any,
    path: str,
    info: ObjectInfo,
    piece: int,
    throttle: Throttle,
    *,
    start: int = 0,
    end: int | None = None,
) -> Iterator[bytes]:
    """One GET of bytes ``[start, end)`` of an S3 object (:func:`s3_get`), its body in
    pieces of at most ``piece`` bytes (:func:`read_body`). Nothing is sent until the first
    piece is asked for."""
    response = s3_get(fs, path, info, throttle, start=start, end=end)
    yield from read_body(fs, response["Body"], piece)


def read_body(fs: Any, body: Any, piece: int) -> Iterator[bytes]:
    """The pieces of a GET response's ``body``, each at most ``piece`` bytes and at most
    ``_MAX_PIECE``; closes it.

    Each piece is gathered on the event loop's thread until it holds ``_MAX_PIECE`` bytes
    (the first ones less: below), the body ends, or ``_MAX_GATHER`` seconds passed (progress
    reports stay frequent on a slow link): over a slow link a read returns only what
    arrived since the last one, a few KiB, and handing every such scrap to this thread
    (a wake-up of each thread, a write, a checksum update, a progress report) cost more
    CPU than the bytes themselves.

    No read asks for more than ``_MAX_PIECE`` either. A read of all aiohttp has buffered
    (several MiB when the server is fast) joined it into a new buffer of a new size each
    time, too big for the allocator to reuse: fresh pages mapped, faulted in 4 KiB at a
    time and unmapped for every piece, the unmapping interrupting every thread of the
    process. Pieces of at most 1 MiB reuse the same memory."""
    most = min(piece, _MAX_PIECE)
    # The first _SMALL_BYTES are handed over in pieces of _FIRST_PIECE, then each piece
    # twice as big up to _MAX_PIECE: a reader following the download sees its first
    # bytes about one round trip after the request, and a first sample of about 100 kB
    # once 128 KiB arrived (13 ms at 10 MB/s), not once 1 MiB did (100 ms), for a few
    # more hand-overs per object.
    least = min(most, _FIRST_PIECE)
    handed = 0
    try:
        while data := sync(fs.loop, _read_piece, body, most, least):
            yield data
            handed += len(data)
            if handed >= _SMALL_BYTES:
                least = min(most, 2 * least)
    finally:
        body.close()


def ask_for_checksums(client: Any) -> None:
    """Have ``client`` (an S3 client) ask for the object's full-object checksum on every
    whole-object GET (header ``x-amz-checksum-mode: ENABLED``), so one GET brings what a
    ``HeadObject`` with ``ChecksumMode`` would. Sent as a header rather than botocore's
    ``ChecksumMode`` parameter, which would also make botocore check the body itself: a
    second checksum of every byte beside ours. Ranged GETs do not ask (S3 returns no
    full-object checksum for a range). Idempotent."""
    client.meta.events.register(
        "before-sign.s3.GetObject", _checksum_mode_header, unique_id=_CHECKSUM_MODE_HANDLER
    )


_CHECKSUM_MODE_HANDLER = "shardcache-checksum-mode"


def _checksum_mode_header(request: Any, **kwargs: Any) -> None:
    if "Range" not in request.headers:
        request.headers["x-amz-checksum-mode"] = "ENABLED"


_MAX_PIECE = 1 << 20  # bytes gathered per hand-over from the event loop (see read_body)
_FIRST_PIECE = 64 << 10  # the first hand-overs of a body...
_SMALL_BYTES = 256 << 10  # ...until this much was handed over
_MAX_GATHER = 0.1  # seconds: a slower piece is handed over with what it has


async def _read_piece(body: Any, most: int, least: int) -> bytes:
    """At most ``most`` bytes of ``body``: at least ``least`` unless the body ends or
    more than ``_MAX_GATHER`` seconds passed since the call (then what has arrived)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _MAX_GATHER
    chunks: list[bytes] = []
    got = 0
    while got < least:
        data = await body.read(most - got)
        if not data:
            break
        chunks.append(data)
        got += len(data)
        if loop.time() >= deadline:
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
