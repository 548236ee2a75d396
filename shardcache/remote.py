"""Remote access through fsspec: object metadata and a verified, chunked, resumable download.

Memory stays bounded by ``chunk_size`` whatever the object size. For S3 the object is
streamed with a single GET (resumed with a ``Range`` request after a transient failure,
guarded by ``If-Match`` on the ETag so a changed object is never stitched together);
other protocols read sequentially through ``fs.open``.

S3 objects of at least ``parallel_threshold`` bytes are fetched with up to
``max_parts_in_flight`` concurrent ranged GETs of ``part_size`` bytes, each written at its
offset into the same temp file (``os.pwrite``), each retried on its own, all guarded by
``If-Match``. Memory stays bounded by parts in flight x a 1 MiB read piece. The size is
checked per part; the MD5 (single-part ETags) is computed afterwards from the file, which
is then still in the page cache.

``pipe:`` URLs (webdataset's shell commands) are run by :mod:`shardcache.pipes`: their size
is unknown until the command ends (``ObjectInfo.size`` is None until :meth:`Remote.download`
returns the info with the size it saw). A run is verified by its exit status (0) and the
byte count; any failed run (nonzero status, a signal, no output for ``io_timeout``) is
retried under the retry policy, because a status does not say whether the cause was
transient, and the last failure is raised as :class:`PipeCommandError`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, BinaryIO, Protocol

import fsspec
from fsspec.asyn import sync

from .errors import (
    FetchError,
    IntegrityError,
    PermanentFetchError,
    PipeCommandError,
    RemoteIsADirectoryError,
    RemoteNotFoundError,
    RemotePermissionError,
    TransientFetchError,
    UrlError,
)
from .pipes import CommandFailed, check_allowed, command_of, run_command
from .redact import get_logger, redact_options
from .retry import (
    DENIED,
    IS_A_DIRECTORY,
    NOT_FOUND,
    TRANSIENT,
    UNTRUSTED,
    RetryPolicy,
    TruncatedBody,
    _http_status_and_code,
    classify,
    describe,
)
from .urls import local_path, url_protocol

logger = get_logger(__name__)

_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_LOCAL_PROTOCOLS = {"file", "local"}


class Progress(Protocol):
    """Observer of one download (the lock heartbeat, the watchdog and progress bars)."""

    def __call__(self, *, phase: str, bytes_done: int, bytes_total: int | None) -> None: ...


def _no_progress(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
    return None


@dataclass(frozen=True)
class ObjectInfo:
    """What we know of a remote object before downloading it."""

    url: str
    size: int | None  # None: known only once downloaded (a pipe: command's output)
    etag: str | None = None
    version_id: str | None = None
    md5: str | None = None  # hex MD5 of the content when the ETag is one (single-part, no KMS)
    mtime_ns: int | None = None  # a local source's modification time (its version)


@dataclass(frozen=True, repr=False)
class RemoteOptions:
    """How to reach remote stores and how hard to try (``repr``: credentials redacted)."""

    storage_options: dict[str, Any] = field(repr=False)  # may hold credentials
    retry: RetryPolicy
    io_timeout: float = 60.0
    chunk_size: int = 8 << 20
    verify: str = "etag"
    parallel_threshold: int = 64 << 20
    """S3 objects at least this big are fetched with parallel ranged GETs."""
    part_size: int = 16 << 20
    max_parts_in_flight: int = 8
    """Concurrent ranged GETs per download; 1 disables the parallel path."""

    def __repr__(self) -> str:
        rest = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"RemoteOptions(storage_options={redact_options(self.storage_options)!r}, {rest})"


_PART_PIECE = 1 << 20  # bytes read from a part's body at a time (bounds memory per part)
_PROGRESS_EVERY = 0.1  # seconds between progress reports of a parallel download


class _PartsCancelled(Exception):
    """A sibling part failed (or the caller stopped): stop this part quietly."""


class _LocalWriteError(Exception):
    """Local file I/O failed (the ``OSError`` is ``__cause__``): not a remote error, never
    retried or classified; :meth:`Remote.download` re-raises the ``OSError`` itself."""


@contextlib.contextmanager
def _local_io() -> Iterator[None]:
    """Mark writes to the caller's file: a full disk (ENOSPC, EDQUOT), a read-only or
    failing file system (EROFS, EIO) is the cache's problem, not the store's."""
    try:
        yield
    except OSError as exc:
        raise _LocalWriteError(str(exc)) from exc


class _Counter:
    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


class Remote:
    """Reads objects from any fsspec URL with our retry policy and verification."""

    def __init__(self, options: RemoteOptions) -> None:
        self.options = options
        self._local = threading.local()
        self._resolved_options: dict[str, dict[str, Any]] = {}

    # -- file systems ----------------------------------------------------------------

    def storage_options_for(self, protocol: str) -> dict[str, Any]:
        """Options for ``protocol``: per-protocol (``{"s3": {...}}``) or flat (non-local only).
        Resolved once per protocol; callers must not modify the result."""
        resolved = self._resolved_options.get(protocol)
        if resolved is None:
            resolved = self._resolved_options[protocol] = self._resolve_options(protocol)
        return resolved

    def _resolve_options(self, protocol: str) -> dict[str, Any]:
        opts = self.options.storage_options
        protocols = set(fsspec.available_protocols())
        per_protocol = {k: v for k, v in opts.items() if k in protocols and isinstance(v, dict)}
        if per_protocol:
            chosen = dict(per_protocol.get(protocol, {}))
        elif protocol in _LOCAL_PROTOCOLS:
            chosen = {}
        else:
            chosen = dict(opts)
        if protocol in {"s3", "s3a"}:
            config = dict(chosen.get("config_kwargs") or {})
            config.setdefault("connect_timeout", self.options.io_timeout)
            config.setdefault("read_timeout", self.options.io_timeout)
            # Our RetryPolicy owns retries: botocore's and s3fs's own would multiply them.
            config.setdefault("retries", {"total_max_attempts": 1})
            chosen["config_kwargs"] = config
        return chosen

    def filesystem(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        """The (cached) file system for ``url`` and the path within it."""
        protocol = url_protocol(url)
        try:
            fs = fsspec.filesystem(protocol, **self.storage_options_for(protocol))
        except ValueError as exc:
            if protocol in fsspec.available_protocols():
                raise
            raise UrlError(
                f"{url}: unknown URL protocol {protocol!r}; expected one fsspec knows (s3, gs, "
                "http, https, file, ...). webdataset opens some schemes with command-line tools: "
                "give those as pipe: commands (e.g. 'pipe:curl -s -L https://...'), or install "
                "the fsspec implementation of the protocol.",
                url=url,
                protocol=protocol,
            ) from exc
        if protocol in {"s3", "s3a"}:
            fs.retries = 1
        if protocol in _LOCAL_PROTOCOLS:
            return fs, local_path(url)
        return fs, fs._strip_protocol(url)

    # -- metadata --------------------------------------------------------------------

    def info(self, url: str) -> ObjectInfo:
        """Size and checksum of ``url``; transient errors are retried. A ``pipe:`` command is
        not run here: its size is None (unknown until :meth:`download`)."""
        if url_protocol(url) == "pipe":
            check_allowed(url)
            return ObjectInfo(url, None)
        return self._with_retries(url, "stat", lambda: self._info_once(url))

    def _info_once(self, url: str) -> ObjectInfo:
        fs, path = self.filesystem(url)
        if url_protocol(url) in {"s3", "s3a"}:
            bucket, key, version = fs.split_path(path)
            kw = {"VersionId": version} if version else {}
            head = sync(fs.loop, fs._call_s3, "head_object", Bucket=bucket, Key=key, **kw)
            etag = str(head.get("ETag", "")).strip('"') or None
            md5 = None
            if (
                etag
                and _MD5_ETAG.match(etag)
                and head.get("ServerSideEncryption") != "aws:kms"
                and "SSECustomerAlgorithm" not in head
            ):
                md5 = etag
            return ObjectInfo(url, int(head["ContentLength"]), etag, head.get("VersionId"), md5)
        if url_protocol(url) in _LOCAL_PROTOCOLS:
            st = os.stat(path)  # before any byte is read: a later change shows on the next hit
            if stat.S_ISDIR(st.st_mode):
                raise self._fetch_error(url, 1, IsADirectoryError(url), IS_A_DIRECTORY, "stat")
            return ObjectInfo(url, st.st_size, mtime_ns=st.st_mtime_ns)
        info = fs.info(path)
        if info.get("type") == "directory":
            raise self._fetch_error(url, 1, IsADirectoryError(url), IS_A_DIRECTORY, "stat")
        size = info.get("size")
        if size is None:
            raise PermanentFetchError(
                f"{url}: the store reports no size, so a download cannot be verified.",
                url=url,
                attempts=1,
                cause="no size",
            )
        etag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
        return ObjectInfo(url, int(size), str(etag).strip('"') if etag else None)

    # -- download --------------------------------------------------------------------

    def download(
        self,
        info: ObjectInfo,
        out: BinaryIO,
        progress: Progress = _no_progress,
    ) -> ObjectInfo:
        """Stream ``info.url`` into ``out`` (positioned at 0) and verify it.

        Resumes after transient failures; raises a :class:`FetchError` subclass or
        :class:`IntegrityError` for the remote side. A failure to write ``out`` (full disk,
        read-only or failing file system) is raised as the ``OSError`` itself, at once and
        without retries, whichever path fetched the bytes. Returns the info the bytes were
        verified against (with the size seen when ``info.size`` was None: a ``pipe:``
        command). Large S3 objects are fetched with parallel ranged GETs (``out`` must then
        have a ``fileno()``); ``out`` is left positioned at the end of the object either way.
        """
        try:
            if info.size is None:
                return self._download_pipe(info, out, progress)
            if self._use_parallel(info, out):
                return self._download_parallel(info, out, progress)
            return self._download_stream(info, out, progress)
        except _LocalWriteError as exc:
            raise exc.__cause__ from None  # type: ignore[misc]

    def _download_stream(self, info: ObjectInfo, out: BinaryIO, progress: Progress) -> ObjectInfo:
        attempt = 0
        done = 0
        md5 = hashlib.md5(usedforsecurity=False)
        while True:
            attempt += 1
            phase = "downloading" if attempt == 1 else f"retry {attempt - 1}"
            try:
                progress(phase=phase, bytes_done=done, bytes_total=info.size)
                for chunk in self._stream(info, done):
                    with _local_io():
                        out.write(chunk)
                    md5.update(chunk)
                    done += len(chunk)
                    progress(phase="downloading", bytes_done=done, bytes_total=info.size)
                    if done > info.size:
                        break
                if done < info.size:
                    raise TruncatedBody(f"body ended at byte {done} of {info.size}")
                self._verify(info, done, md5.hexdigest(), attempt)
                return info
            except IntegrityError:
                if not self.options.retry.allows(attempt):
                    raise
                # Corrupted in transit or changed underneath: start again from byte 0 with
                # fresh metadata (a replaced object has a new size and ETag).
                logger.warning("%s failed verification; downloading it again", info.url)
                info = self.info(info.url)
                with _local_io():
                    out.seek(0)
                    out.truncate()
                done, md5 = 0, hashlib.md5(usedforsecurity=False)
            except _LocalWriteError:
                raise
            except Exception as exc:
                kind = classify(exc)
                if kind != TRANSIENT or not self.options.retry.allows(attempt):
                    raise self._fetch_error(info.url, attempt, exc, kind) from exc
                logger.info("retrying %s after %s (attempt %d)", info.url, describe(exc), attempt)
            time.sleep(self.options.retry.delay(attempt))

    # -- pipe: commands --------------------------------------------------------------

    def _download_pipe(self, info: ObjectInfo, out: BinaryIO, progress: Progress) -> ObjectInfo:
        """Run the command until one run exits 0, each run from byte 0 (a command cannot be
        resumed); PipeCommandError after the last allowed attempt."""
        command = command_of(info.url)

        def write(data: bytes) -> None:
            with _local_io():
                out.write(data)

        attempt = 0
        while True:
            attempt += 1
            phase = "running command" if attempt == 1 else f"retry {attempt - 1}"

            def moved(done: int, phase: str = phase) -> None:
                progress(phase=phase, bytes_done=done, bytes_total=None)

            with _local_io():
                out.seek(0)
                out.truncate()
            try:
                size = run_command(
                    command,
                    write,
                    moved,
                    io_timeout=self.options.io_timeout,
                    chunk_size=self.options.chunk_size,
                )
                return replace(info, size=size)
            except CommandFailed as exc:
                failure = exc
            what = failure.describe(self.options.io_timeout)
            if not self.options.retry.allows(attempt):
                raise self._pipe_error(info.url, attempt, failure, what) from failure
            logger.info("retrying pipe command %r (attempt %d): it %s", command, attempt, what)
            time.sleep(self.options.retry.delay(attempt))

    @staticmethod
    def _pipe_error(url: str, attempts: int, failure: CommandFailed, what: str) -> PipeCommandError:
        return PipeCommandError(
            f"pipe command {failure.command!r} {what}. An exit status does not say whether a "
            f"failure is transient, so every failure is retried: it failed on all {attempts} "
            f"attempt(s) (SHARDCACHE_RETRIES={attempts - 1}) and nothing was cached. Run the "
            "command in a shell to see why (it must write the shard to its standard output "
            "and exit with status 0).",
            url=url,
            attempts=attempts,
            cause=what,
            command=failure.command,
            exit_status=failure.exit_status,
            stderr=failure.stderr,
            timed_out=failure.timed_out,
        )

    # -- parallel ranged download (large S3 objects) -----------------------------------

    def _use_parallel(self, info: ObjectInfo, out: BinaryIO) -> bool:
        opts = self.options
        if url_protocol(info.url) not in {"s3", "s3a"} or opts.max_parts_in_flight < 2:
            return False
        if info.size < max(opts.parallel_threshold, 2 * opts.part_size):
            return False
        try:
            out.fileno()
        except (AttributeError, OSError, ValueError):
            return False
        return True

    def _download_parallel(self, info: ObjectInfo, out: BinaryIO, progress: Progress) -> ObjectInfo:
        attempt = 0
        while True:
            attempt += 1
            try:
                self._fetch_parts(info, out, progress, attempt)
                if self.options.verify == "etag" and info.md5:
                    progress(phase="verifying", bytes_done=info.size, bytes_total=info.size)
                    self._verify(info, info.size, self._hash_file(out, info.size), attempt)
                out.seek(info.size)
                return info
            except IntegrityError:
                if not self.options.retry.allows(attempt):
                    raise
                logger.warning("%s failed verification; downloading it again", info.url)
                time.sleep(self.options.retry.delay(attempt))
                info = self.info(info.url)
                with _local_io():
                    out.seek(0)
                    out.truncate()
                if not self._use_parallel(info, out):
                    return self._download_stream(info, out, progress)

    def _fetch_parts(
        self, info: ObjectInfo, out: BinaryIO, progress: Progress, attempt: int
    ) -> None:
        with _local_io():
            out.flush()
            fd = out.fileno()
            if os.fstat(fd).st_size < info.size:
                os.ftruncate(fd, info.size)  # parts land at their offsets in any order
        part = self.options.part_size
        ranges = [(start, min(start + part, info.size)) for start in range(0, info.size, part)]
        done = _Counter()
        cancel = threading.Event()
        phase = "downloading" if attempt == 1 else f"retry {attempt - 1}"
        progress(phase=phase, bytes_done=0, bytes_total=info.size)
        pool = cf.ThreadPoolExecutor(
            max_workers=min(len(ranges), self.options.max_parts_in_flight),
            thread_name_prefix="shardcache-part",
        )
        try:
            futures = [
                pool.submit(self._fetch_part, info, fd, span, done, cancel) for span in ranges
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
                    progress(phase="downloading", bytes_done=reported, bytes_total=info.size)
        finally:
            cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
        if done.value != info.size:  # every part checks its own length; belt and braces
            raise IntegrityError(
                f"{info.url}: parallel download wrote {done.value} bytes, expected {info.size}",
                url=info.url,
                attempts=attempt,
                expected=info.size,
                seen=done.value,
            )

    def _fetch_part(
        self,
        info: ObjectInfo,
        fd: int,
        span: tuple[int, int],
        done: _Counter,
        cancel: threading.Event,
    ) -> None:
        """Write bytes ``[start, end)`` of the object at their offset; resumes and retries."""
        start, end = span
        pos = start
        attempt = 0
        while True:
            attempt += 1
            if cancel.is_set():
                raise _PartsCancelled
            try:
                for chunk in self._range_s3(info, pos, end):
                    if cancel.is_set():
                        raise _PartsCancelled
                    if len(chunk) > end - pos:
                        raise IntegrityError(
                            f"{info.url}: the store sent more than the requested range "
                            f"bytes={pos}-{end - 1}; nothing was published.",
                            url=info.url,
                            attempts=attempt,
                            expected=end - pos,
                            seen=len(chunk),
                        )
                    view = memoryview(chunk)
                    while view:
                        with _local_io():
                            written = os.pwrite(fd, view, pos)
                        view = view[written:]
                        pos += written
                        done.add(written)
                if pos < end:
                    raise TruncatedBody(f"part body ended at byte {pos}, expected {end}")
                return
            except (_PartsCancelled, _LocalWriteError, IntegrityError):
                raise
            except Exception as exc:
                self._part_failed(info, attempt, exc, cancel)

    def _part_failed(
        self, info: ObjectInfo, attempt: int, exc: Exception, cancel: threading.Event
    ) -> None:
        """Raise the right error for a failed part, or wait before its next attempt."""
        for item in (exc, exc.__cause__, exc.__context__):
            if item is not None and _http_status_and_code(item)[0] == 412:
                raise IntegrityError(
                    f"{info.url} changed during the download (If-Match on ETag {info.etag} "
                    "failed); nothing was published.",
                    url=info.url,
                    attempts=attempt,
                    expected=info.etag,
                    seen="another version",
                ) from exc
        kind = classify(exc)
        if kind != TRANSIENT or not self.options.retry.allows(attempt):
            raise self._fetch_error(info.url, attempt, exc, kind) from exc
        logger.info("retrying a part of %s after %s (attempt %d)", info.url, describe(exc), attempt)
        if cancel.wait(self.options.retry.delay(attempt)):
            raise _PartsCancelled from exc

    def _range_s3(self, info: ObjectInfo, start: int, end: int) -> Iterator[bytes]:
        fs, path = self.filesystem(info.url)
        bucket, key, version = fs.split_path(path)
        kw: dict[str, Any] = {"Range": f"bytes={start}-{end - 1}"}
        if version or info.version_id:
            kw["VersionId"] = version or info.version_id
        if info.etag:
            kw["IfMatch"] = f'"{info.etag}"'
        response = sync(fs.loop, fs._call_s3, "get_object", Bucket=bucket, Key=key, **kw)
        body = response["Body"]
        piece = min(self.options.chunk_size, _PART_PIECE)
        try:
            while data := sync(fs.loop, body.read, piece):
                yield data
        finally:
            body.close()

    def _hash_file(self, out: BinaryIO, size: int) -> str:
        md5 = hashlib.md5(usedforsecurity=False)
        fd = out.fileno()
        pos = 0
        while pos < size:
            with _local_io():
                data = os.pread(fd, min(self.options.chunk_size, size - pos), pos)
            if not data:
                break
            md5.update(data)
            pos += len(data)
        return md5.hexdigest()

    def _stream(self, info: ObjectInfo, offset: int) -> Iterator[bytes]:
        fs, path = self.filesystem(info.url)
        chunk = self.options.chunk_size
        if url_protocol(info.url) in {"s3", "s3a"}:
            yield from self._stream_s3(fs, path, info, offset, chunk)
            return
        if url_protocol(info.url) in {"http", "https"}:
            yield from self._stream_http(fs, path, info, offset, chunk)
            return
        with fs.open(path, "rb", block_size=chunk) as f:
            if offset:
                f.seek(offset)
            while data := f.read(chunk):
                yield data

    @staticmethod
    def _stream_http(
        fs: Any, path: str, info: ObjectInfo, offset: int, chunk: int
    ) -> Iterator[bytes]:
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

    @staticmethod
    def _stream_s3(
        fs: Any, path: str, info: ObjectInfo, offset: int, chunk: int
    ) -> Iterator[bytes]:
        bucket, key, version = fs.split_path(path)
        kw: dict[str, Any] = {}
        if version or info.version_id:
            kw["VersionId"] = version or info.version_id
        if offset:
            kw["Range"] = f"bytes={offset}-"
            if info.etag:
                kw["IfMatch"] = f'"{info.etag}"'
        response = sync(fs.loop, fs._call_s3, "get_object", Bucket=bucket, Key=key, **kw)
        body = response["Body"]
        try:
            while data := sync(fs.loop, body.read, chunk):
                yield data
        finally:
            body.close()

    def _verify(self, info: ObjectInfo, size: int, md5_hex: str, attempt: int) -> None:
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
        if self.options.verify == "etag" and info.md5 and md5_hex != info.md5:
            raise IntegrityError(
                f"{info.url}: MD5 of the downloaded bytes is {md5_hex}, expected {info.md5} "
                f"(the ETag) on attempt {attempt}. The bytes were corrupted in transit or the "
                "object changed; nothing was published. Check the network path (proxies) and "
                "the object; set SHARDCACHE_VERIFY=size if this store's ETags are not MD5s.",
                url=info.url,
                attempts=attempt,
                expected=info.md5,
                seen=md5_hex,
            )

    # -- errors ----------------------------------------------------------------------

    def _with_retries(self, url: str, what: str, call: Callable[[], ObjectInfo]) -> ObjectInfo:
        attempt = 0
        while True:
            attempt += 1
            try:
                return call()
            except (FetchError, UrlError):
                raise
            except Exception as exc:
                kind = classify(exc)
                if kind != TRANSIENT or not self.options.retry.allows(attempt):
                    raise self._fetch_error(url, attempt, exc, kind, what) from exc
                logger.info("retrying %s of %s after %s", what, url, describe(exc))
                time.sleep(self.options.retry.delay(attempt))

    def _fetch_error(
        self, url: str, attempts: int, exc: BaseException, kind: str, what: str = "download"
    ) -> FetchError:
        cause = describe(exc)
        if kind == NOT_FOUND:
            return RemoteNotFoundError(
                f"{url} does not exist ({cause}); failed at once, without retries. Check the "
                "bucket and key (and the endpoint: AWS_ENDPOINT_URL / storage_options).",
                url=url,
                attempts=attempts,
                cause=cause,
            )
        if kind == TRANSIENT:
            return TransientFetchError(
                f"could not {what} {url}: {attempts} attempts failed with transient errors; "
                f"last: {cause}. The store is overloaded or unreachable: retry later, or raise "
                "SHARDCACHE_RETRIES / SHARDCACHE_IO_TIMEOUT.",
                url=url,
                attempts=attempts,
                cause=cause,
            )
        if kind == DENIED:
            return RemotePermissionError(
                f"could not {what} {url}: permission denied ({cause}); failed at once, without "
                "retries. Check the credentials (AWS_* / storage_options), the bucket policy "
                "or the file's permissions for this user.",
                url=url,
                attempts=attempts,
                cause=cause,
            )
        if kind == IS_A_DIRECTORY:
            return RemoteIsADirectoryError(
                f"{url} is a directory, expected a shard file; failed at once. List the shards "
                "(or use a brace pattern) instead.",
                url=url,
                attempts=attempts,
                cause=cause,
            )
        if kind == UNTRUSTED:
            return PermanentFetchError(
                f"could not {what} {url}: the server's TLS certificate was rejected ({cause}); "
                "failed at once, without retries: the same certificate comes back on every "
                "attempt. Check the host name in the URL, or make the certificate trusted "
                "(SSL_CERT_FILE for https://, AWS_CA_BUNDLE for s3://).",
                url=url,
                attempts=attempts,
                cause=cause,
            )
        return PermanentFetchError(
            f"could not {what} {url}: {cause}; not retried because retrying cannot fix it. "
            "Check credentials, permissions and the URL.",
            url=url,
            attempts=attempts,
            cause=cause,
        )
