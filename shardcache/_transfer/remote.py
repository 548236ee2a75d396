"""Remote access through fsspec: file systems, object metadata, and the choice of a download.

:meth:`Remote.info` stats an object (retried under the retry policy); :meth:`Remote.download` hands
it to one strategy (:mod:`shardcache._transfer.download`): ``pipe:`` URLs (size unknown) to
:mod:`~shardcache._transfer.pipe_download`, S3 objects of at least ``parallel_threshold`` bytes to
:mod:`~shardcache._transfer.parallel_download`, everything else to
:mod:`~shardcache._transfer.stream_download`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import fsspec
from fsspec.asyn import sync

from .._base.errors import FetchError, IntegrityError, PermanentFetchError, UrlError
from .._base.redact import get_logger
from .._base.url_check import check_url
from .._base.url_kinds import LOCAL_PROTOCOLS, local_path, s3_version, url_protocol
from .._config.borrowed import gcsfs_extended, s3_endpoint_variable
from .._observe import metrics
from .._retry.policy import describe, fetch_error, is_transient, retry_cause
from .._retry.throttle import throttled_call
from .azure import AZURE_PROTOCOLS, azure_filesystem, azure_gets, azure_object_info
from .checksums import etag_checksum, from_s3_head
from .download import (
    LocalWriteError,
    ObjectInfo,
    OpenedObject,
    Progress,
    RemoteOptions,
    Strategy,
    ask_for_checksums,
    no_progress,
    s3_body,
    s3_get,
)
from .gcs import GCS_PROTOCOLS, gcs_filesystem, gcs_object_info
from .multipart import PartLayout, exact_layout, part_checksums, part_layout
from .parallel_download import ParallelDownload
from .pipe_commands import check_allowed
from .pipe_download import PipeDownload
from .ranged_gets import ranged_reads
from .s3_client import s3_client_options, share_service_models
from .stream_download import StreamDownload

logger = get_logger(__name__)

_T = TypeVar("_T")
_DECIDED = (FetchError, UrlError)  # errors of ours: raised as they are, never retried
_SETTLED = (*_DECIDED, IntegrityError)  # a ranged read of an object that changed, too


class Remote:
    """Reads objects from any fsspec URL with our retry policy and verification."""

    def __init__(self, options: RemoteOptions) -> None:
        self.options = options
        self._resolved_options: dict[str, dict[str, Any]] = {}
        self._filesystems: dict[str, tuple[int, fsspec.AbstractFileSystem]] = {}
        self.stream = StreamDownload(self)
        self.parallel = ParallelDownload(self, fallback=self.stream)
        self.pipe = PipeDownload(self)

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
        elif protocol in LOCAL_PROTOCOLS:
            chosen = {}
        else:
            chosen = dict(opts)
        if protocol in {"s3", "s3a"}:
            chosen = s3_client_options(chosen, self.options)
        return chosen

    def filesystem(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        """The file system for ``url`` and the path within it.

        An asynchronous one (s3, http, gcs, ...) is made once per process and shared by
        every thread: its requests run on fsspec's own event-loop thread, and one client
        keeps one connection pool and one parsed service model. (fsspec alone would make
        one per thread in older versions, and botocore adds keys to the ``config_kwargs``
        it is given, which changes fsspec's cache key and made a second client.)"""
        protocol = url_protocol(url)
        pid = os.getpid()
        made = self._filesystems.get(protocol)
        if made is not None and made[0] == pid:
            fs = made[1]
        else:
            fs = self._make_filesystem(url, protocol)
            if getattr(fs, "async_impl", False):
                self._filesystems[protocol] = (pid, fs)
        if protocol in LOCAL_PROTOCOLS:
            return fs, local_path(url)
        return fs, fs._strip_protocol(url)

    def _make_filesystem(self, url: str, protocol: str) -> fsspec.AbstractFileSystem:
        options = _fresh(self.storage_options_for(protocol))
        try:
            if protocol in GCS_PROTOCOLS:
                return gcs_filesystem(options, gcsfs_extended())
            if protocol in AZURE_PROTOCOLS:
                return azure_filesystem(options)
            fs = fsspec.filesystem(protocol, **options)
        except ValueError:
            check_url(url)  # an unknown protocol: the UrlError expand_urls raises for it
            raise
        if protocol in {"s3", "s3a"}:
            fs.retries = 1
            share_service_models(fs)
        return fs

    def endpoint_of(self, url: str) -> str | None:
        """Where requests for ``url`` go and what set it, in words; None for the store's
        default endpoint (and for local files and commands)."""
        protocol = url_protocol(url)
        options = self.storage_options_for(protocol)
        client = options.get("client_kwargs") or {}
        for name, value in (
            ("storage_options endpoint_url", options.get("endpoint_url")),
            ("storage_options client_kwargs.endpoint_url", client.get("endpoint_url")),
            ("storage_options account_url", options.get("account_url")),
        ):
            if isinstance(value, str) and value:
                return f"{value} (from {name})"
        if options.get("connection_string"):
            return "the BlobEndpoint of storage_options connection_string"
        found = s3_endpoint_variable() if protocol in {"s3", "s3a"} else None
        return None if found is None else f"{found[1]} (from {found[0]})"

    def fetch_error(
        self, url: str, attempts: int, exc: BaseException, what: str = "download"
    ) -> FetchError:
        """:func:`~shardcache._retry.policy.fetch_error`, naming ``url``'s endpoint."""
        return fetch_error(url, attempts, exc, what, self.endpoint_of(url))

    # -- metadata --------------------------------------------------------------------

    def info(self, url: str) -> ObjectInfo:
        """Size and checksum of ``url``; transient errors are retried. A ``pipe:`` command is
        not run here: its size is None (unknown until :meth:`download`)."""
        if url_protocol(url) == "pipe":
            check_allowed(url)
            return ObjectInfo(url, None)
        return self.options.retry.run(
            lambda n: self._info_once(url),
            retry_if=lambda exc: not isinstance(exc, _DECIDED) and is_transient(exc),
            give_up=lambda exc, n: (
                exc if isinstance(exc, _DECIDED) else self.fetch_error(url, n, exc, "stat")
            ),
            on_retry=lambda exc, n: _stat_retry(url, exc),
        )

    def _info_once(self, url: str) -> ObjectInfo:
        fs, path = self.filesystem(url)
        protocol = url_protocol(url)
        if protocol in {"s3", "s3a"}:
            bucket, key, version = fs.split_path(path)
            version = version or s3_version(path)
            kw = {"VersionId": version} if version else {}
            head = throttled_call(
                self.options.throttle,
                "HEAD",
                lambda: sync(
                    fs.loop,
                    fs._call_s3,
                    "head_object",
                    Bucket=bucket,
                    Key=key,
                    ChecksumMode="ENABLED",  # the object's additional checksum, if it has one
                    **kw,
                ),
            )
            return s3_object_info(url, head, self.options.etag_md5)
        if protocol in LOCAL_PROTOCOLS:
            st = os.stat(path)  # before any byte is read: a later change shows on the next hit
            if stat.S_ISDIR(st.st_mode):
                raise self.fetch_error(url, 1, IsADirectoryError(url), "stat")
            return ObjectInfo(url, st.st_size, mtime_ns=st.st_mtime_ns)
        if protocol in GCS_PROTOCOLS:
            return gcs_object_info(fs, url, path, self.options.throttle)
        if protocol in AZURE_PROTOCOLS:
            return azure_object_info(fs, url, path, self.options.throttle)
        info = fs.info(path)
        if info.get("type") == "directory":
            raise self.fetch_error(url, 1, IsADirectoryError(url), "stat")
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

    def open(self, url: str) -> OpenedObject:
        """The object at ``url`` opened for a download: for S3, one GET of the whole object
        whose response headers give its info (size, ETag, version, full-object checksum) and
        whose body :meth:`download` then reads, so a cold object costs one request, not a
        HEAD and a GET; for other stores, :meth:`info` (their download sends its own
        request). Transient errors are retried; a missing object raises
        :class:`~shardcache.RemoteNotFoundError` at once. Close the result (a ``with``
        block) if its body may go unread."""
        if url_protocol(url) not in {"s3", "s3a"}:
            return OpenedObject(self.info(url))
        fs, path = self.filesystem(url)
        unknown = ObjectInfo(url, None)
        pinned = s3_version(path)

        def once(n: int) -> OpenedObject:
            # The client s3fs made (made now if it has none yet: a hop to its event loop
            # only then); registering is idempotent.
            client = getattr(fs, "_s3", None) or sync(fs.loop, fs.set_session)
            ask_for_checksums(client)
            response = s3_get(fs, path, unknown, self.options.throttle)
            info = s3_object_info(url, response, self.options.etag_md5)
            if pinned is not None and info.version_id != pinned:
                response["Body"].close()
                raise _other_version(url, pinned, info.version_id)
            return OpenedObject(info, fs, response["Body"])

        return self.options.retry.run(
            once,
            retry_if=lambda exc: not isinstance(exc, _DECIDED) and is_transient(exc),
            give_up=lambda exc, n: (
                exc if isinstance(exc, _DECIDED) else self.fetch_error(url, n, exc)
            ),
            on_retry=lambda exc, n: _open_retry(url, exc),
        )

    def part_layout(self, info: ObjectInfo, parts: int, *, exact: bool) -> PartLayout | None:
        """The layout of the ``parts`` parts of the S3 object ``info`` describes
        (:func:`~shardcache._transfer.multipart.part_layout`; ``exact``: every part's size
        asked for, :func:`~shardcache._transfer.multipart.exact_layout`); None for other
        stores. Transient errors are retried."""
        learn = exact_layout if exact else part_layout
        return self._about_parts(
            info,
            lambda fs, path: learn(
                fs,
                path,
                version=info.version_id,
                total=info.size or 0,
                count=parts,
                throttle=self.options.throttle,
            ),
        )

    def part_checksums(self, info: ObjectInfo, algorithm: str, parts: int) -> list[str] | None:
        """Each of the ``parts`` parts' own ``algorithm`` checksum as the S3 store reports it
        (:func:`~shardcache._transfer.multipart.part_checksums`), or None."""
        return self._about_parts(
            info,
            lambda fs, path: part_checksums(
                fs,
                path,
                version=info.version_id,
                count=parts,
                algorithm=algorithm,
                throttle=self.options.throttle,
            ),
        )

    def _about_parts(self, info: ObjectInfo, ask: Callable[[Any, str], _T]) -> _T | None:
        """``ask(fs, path)`` of an S3 object's parts, retried as a stat is; None for other
        stores."""
        if url_protocol(info.url) not in {"s3", "s3a"} or info.size is None:
            return None
        fs, path = self.filesystem(info.url)
        return self.options.retry.run(
            lambda n: ask(fs, path),
            retry_if=lambda exc: not isinstance(exc, _DECIDED) and is_transient(exc),
            give_up=lambda exc, n: (
                exc if isinstance(exc, _DECIDED) else self.fetch_error(info.url, n, exc, "stat")
            ),
            on_retry=lambda exc, n: _stat_retry(info.url, exc),
        )

    # -- ranged reads ------------------------------------------------------------------

    def read_range(self, url: str, start: int, end: int, etag: str | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``url`` (fewer at the object's end), uncached: one ranged
        GET on S3 and Azure (``If-Match`` on ``etag`` when given: a changed object is an
        error, not other bytes), retried as downloads are."""
        fs, path = self.filesystem(url)
        protocol = url_protocol(url)
        if protocol in AZURE_PROTOCOLS:
            info = ObjectInfo(url, None, etag)
            return self.options.retry.run(
                lambda n: b"".join(
                    ranged_reads(
                        info,
                        end - start,
                        self.options.throttle,
                        azure_gets(fs, path, info),
                        start=start,
                        end=end,
                    )
                ),
                retry_if=lambda exc: not isinstance(exc, _SETTLED) and is_transient(exc),
                give_up=lambda exc, n: (
                    exc if isinstance(exc, _SETTLED) else self.fetch_error(url, n, exc)
                ),
            )
        if protocol not in {"s3", "s3a"}:
            return self.options.retry.run(
                lambda n: fs.cat_file(path, start=start, end=end),
                retry_if=lambda exc: not isinstance(exc, _DECIDED) and is_transient(exc),
                give_up=lambda exc, n: self.fetch_error(url, n, exc),
            )
        info = ObjectInfo(url, None, etag)
        chunk = self.options.chunk_size
        return self.options.retry.run(
            lambda n: b"".join(
                s3_body(fs, path, info, chunk, self.options.throttle, start=start, end=end)
            ),
            retry_if=lambda exc: not isinstance(exc, _DECIDED) and is_transient(exc),
            give_up=lambda exc, n: self.fetch_error(url, n, exc),
            on_retry=lambda exc, n: metrics.retried(retry_cause(exc)),
        )

    # -- download --------------------------------------------------------------------

    def download(
        self,
        info: ObjectInfo,
        out: BinaryIO,
        progress: Progress = no_progress,
        opened: OpenedObject | None = None,
    ) -> ObjectInfo:
        """Stream ``info.url`` into ``out`` (positioned at 0) and verify it; ``opened``
        (from :meth:`open`) gives the body of the object's GET, already answered.

        Resumes after transient failures; raises a :class:`FetchError` subclass or
        :class:`IntegrityError` for the remote side. A failure to write ``out`` (full disk,
        read-only or failing file system) is raised as the ``OSError`` itself, at once and
        without retries, whichever path fetched the bytes. Returns the info the bytes were
        verified against (with the size seen when ``info.size`` was None: a ``pipe:``
        command). Large S3 objects are fetched with parallel ranged GETs (``out`` must then
        have a ``fileno()``); ``out`` is left positioned at the end of the object either way.
        """
        if info.size is None:
            strategy: Strategy = self.pipe
        elif self.parallel.suits(info, out):
            strategy = self.parallel
        else:
            strategy = self.stream
        try:
            return strategy.download(info, out, progress, opened)
        except LocalWriteError as exc:
            raise exc.__cause__ from None  # type: ignore[misc]


def s3_object_info(url: str, response: Any, etag_md5: str = "auto") -> ObjectInfo:
    """What a ``HeadObject`` response, or a whole-object ``GetObject`` one, says of the object.
    The ETag is taken for an MD5 (of the content, or of the parts' MD5s: ``-N``) only where
    S3 promises it (:func:`etag_is_md5`) and ``etag_md5`` is not ``off``."""
    etag = str(response.get("ETag", "")).strip('"') or None
    promised = etag_md5 != "off" and etag_is_md5(url, response)
    return ObjectInfo(
        url,
        int(response["ContentLength"]),
        etag,
        response.get("VersionId"),
        etag_checksum(etag) if promised else None,
        checksum=from_s3_head(response, multipart_etag=bool(etag and "-" in etag)),
    )


def etag_is_md5(url: str, response: Any) -> bool:
    """Whether S3 promises the ETag of the object ``response`` describes is an MD5: not
    for any KMS encryption (``aws:kms``, ``aws:kms:dsse``), a customer-provided key (SSE-C)
    or a directory bucket (S3 Express One Zone: ``--x-s3``), whose ETags are not."""
    sse = str(response.get("ServerSideEncryption") or "")
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    return (
        not sse.startswith("aws:kms")
        and "SSECustomerAlgorithm" not in response
        and not bucket.endswith(_DIRECTORY_BUCKET)
    )


_DIRECTORY_BUCKET = "--x-s3"


def _other_version(url: str, pinned: str, seen: str | None) -> PermanentFetchError:
    """A GET of the version ``pinned`` answered with another version's bytes."""
    return PermanentFetchError(
        f"{url}: the store answered version {seen!r} for a GET of version {pinned!r}; its "
        "bytes are not served for the version asked. Check that the bucket keeps versions "
        "and that the endpoint honours versionId",
        url=url,
        attempts=1,
        cause="other version",
        expected=pinned,
        seen=seen,
    )


def _stat_retry(url: str, exc: Exception) -> None:
    metrics.retried(retry_cause(exc))
    logger.info("retrying stat of %s after %s", url, describe(exc))


def _open_retry(url: str, exc: Exception) -> None:
    metrics.retried(retry_cause(exc))
    logger.info("retrying the GET of %s after %s", url, describe(exc))


def _fresh(options: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` whose dicts are new (the file system's client may add keys to
    them); other values (a session, credentials) are passed as they are."""
    return {k: _fresh(v) if isinstance(v, dict) else v for k, v in options.items()}
