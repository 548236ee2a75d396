"""The single-stream download: one GET (S3, HTTP), ranged GETs pinned to the object's
version (GCS: its generation; Azure: ``If-Match`` on its ETag) or a sequential read (other
fsspec stores), resumed after a transient failure at the byte it reached.

Memory stays bounded by ``chunk_size`` whatever the object size. An S3 resume is a
``Range`` request guarded by ``If-Match`` on the ETag, so a changed object is never
stitched together. The checksum (the object's S3 checksum, else the ETag's MD5) is
computed while the bytes go by; a failed verification starts again from byte 0 with
fresh metadata (a replaced object has a new size and ETag).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any, BinaryIO

from .._base.redact import get_logger
from .._base.url_kinds import url_protocol
from .._observe import metrics
from .._retry.policy import TruncatedBody, describe, is_transient, retry_cause
from .azure import AZURE_PROTOCOLS, azure_gets
from .checksums import MESH_CRC, Hasher
from .download import (
    Expected,
    LocalWriteError,
    ObjectInfo,
    OpenedObject,
    Progress,
    Strategy,
    changed_underneath,
    local_io,
    precondition_failed,
    s3_body,
    verification_failed,
)
from .gcs import GCS_PROTOCOLS, gcs_gets
from .multipart import PartsHasher
from .ranged_gets import ranged_reads

logger = get_logger(__name__)


class StreamDownload(Strategy):
    """Any object from any store, one stream at a time."""

    def download(
        self,
        info: ObjectInfo,
        out: BinaryIO,
        progress: Progress,
        opened: OpenedObject | None = None,
    ) -> ObjectInfo:
        state = _Stream(info, self.expectation(info))
        first = opened.take(self.options.chunk_size) if opened is not None else None

        def attempt(n: int) -> ObjectInfo:
            nonlocal first
            progress(phase=self.phase(n), bytes_done=state.done, bytes_total=state.info.size)
            chunks, first = first or self.chunks(state.info, state.done), None
            chunks = _unchanged(chunks, state.info, n)
            for chunk in chunks:
                with local_io():
                    out.write(chunk)
                if state.hasher is not None:
                    state.hasher.update(chunk)
                state.crc.update(chunk)
                state.done += len(chunk)
                progress(phase="downloading", bytes_done=state.done, bytes_total=state.info.size)
                if state.done > state.info.size:
                    break
            if state.done < state.info.size:
                raise TruncatedBody(f"body ended at byte {state.done} of {state.info.size}")
            digest = state.hasher.value() if state.hasher is not None else None
            verified = self.verify(
                state.info,
                state.done,
                digest,
                n,
                expected=state.expected,
                out=_file(out),
                part_digests=state.hasher.digests
                if isinstance(state.hasher, PartsHasher)
                else None,
            )
            return replace(verified, mesh_crc32c=state.crc.value())

        def on_retry(exc: Exception, n: int) -> None:
            metrics.retried(retry_cause(exc))
            if verification_failed(exc):
                fresh = self.start_over(state.info.url, out)
                state.restart(fresh, self.expectation(fresh))
            else:
                logger.info("retrying %s after %s (attempt %d)", state.info.url, describe(exc), n)

        def give_up(exc: Exception, n: int) -> BaseException:
            if verification_failed(exc) or isinstance(exc, LocalWriteError):
                return exc
            return self.source.fetch_error(state.info.url, n, exc)

        return self.options.retry.run(
            attempt,
            retry_if=lambda exc: verification_failed(exc) or _transient(exc),
            give_up=give_up,
            on_retry=on_retry,
        )

    def chunks(self, info: ObjectInfo, offset: int) -> Iterator[bytes]:
        """The object's bytes from ``offset`` on, in chunks of at most ``chunk_size``."""
        fs, path = self.source.filesystem(info.url)
        chunk = self.options.chunk_size
        protocol = url_protocol(info.url)
        if protocol in {"s3", "s3a"}:
            yield from s3_body(fs, path, info, chunk, self.options.throttle, start=offset)
            return
        if protocol in GCS_PROTOCOLS:  # every read pinned to the object's generation
            gets = gcs_gets(fs, path, info)
            yield from ranged_reads(info, chunk, self.options.throttle, gets, start=offset)
            return
        if protocol in AZURE_PROTOCOLS:  # every read with If-Match on the blob's ETag
            gets = azure_gets(fs, path, info)
            yield from ranged_reads(info, chunk, self.options.throttle, gets, start=offset)
            return
        if protocol in {"http", "https"}:
            yield from _http_body(fs, path, info, offset, chunk)
            return
        with fs.open(path, "rb", block_size=chunk) as f:
            if offset:
                f.seek(offset)
            while data := f.read(chunk):
                yield data


class _Stream:
    """Where a stream stands: the object it verifies against, bytes written, their
    checksum (None: verified by size only) and their CRC32C (``mesh_crc32c``)."""

    def __init__(self, info: ObjectInfo, expected: Expected) -> None:
        self.restart(info, expected)

    def restart(self, info: ObjectInfo, expected: Expected) -> None:
        self.info = info
        self.expected = expected
        self.done = 0
        self.hasher = expected.hasher()
        self.crc = Hasher(MESH_CRC)


def _file(out: BinaryIO) -> BinaryIO | None:
    """``out`` when it is a real file (a multipart checksum can be computed again from it)."""
    try:
        out.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return out


def _unchanged(chunks: Iterator[bytes], info: ObjectInfo, attempt: int) -> Iterator[bytes]:
    """``chunks``, with the store's refusal of a resume (HTTP 412: the object was replaced)
    raised as the failed verification it is, so the download starts over on the new one."""
    try:
        yield from chunks
    except Exception as exc:
        if precondition_failed(exc):
            raise changed_underneath(info, attempt) from exc
        raise


def _transient(exc: Exception) -> bool:
    return not isinstance(exc, LocalWriteError) and is_transient(exc)


def _http_body(fs: Any, path: str, info: ObjectInfo, offset: int, chunk: int) -> Iterator[bytes]:
    """One streaming GET. fsspec's block reads send a ranged GET per block and fail
    (ValueError) on servers that ignore Range, such as Python's ``http.server``; so a
    resumed download reads the body again from the start and skips what is written."""
    with fs.open(path, "rb", block_size=0, size=info.size) as f:
        while data := f.read(chunk):
            if offset >= len(data):
                offset -= len(data)
                continue
            yield data[offset:]
            offset = 0
