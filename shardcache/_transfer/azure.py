"""Azure Blob Storage through adlfs (``abfs://``, ``abfss://``, ``az://``): a blob's
properties, and its bytes read conditional on the ETag seen first.

A blob's properties (one ``HEAD``) give its size, ETag and, where the uploader or the
service set it, its ``Content-MD5`` (the service sets it for a blob written in one ``Put
Blob``; a blob committed from blocks has one only if the uploader gave it). Azure returns
a CRC64 only for a single request's bytes, never for a whole blob, so Content-MD5 is the
only whole-blob checksum there is. Every read of a download is a ranged ``GET`` with
``If-Match`` on the ETag, so a replaced blob is never stitched together: HTTP 412 (or 404:
deleted) is raised as :class:`IntegrityError`, and the download starts over on the new blob.
"""

from __future__ import annotations

from typing import Any

from fsspec.asyn import sync

from .._base.errors import IntegrityError
from .._base.extras import require_extras
from .._retry.throttle import Throttle, throttled_call
from .checksums import Checksum
from .download import ObjectInfo, changed_underneath
from .ranged_gets import RangedGets

AZURE_PROTOCOLS = frozenset({"abfs", "abfss", "az"})


def azure_filesystem(options: dict[str, Any]) -> Any:
    """An adlfs file system made with ``options``."""
    require_extras("abfs:// and az:// URLs", "azure")
    import fsspec

    return fsspec.filesystem("abfs", **options)


def azure_object_info(fs: Any, url: str, path: str, throttle: Throttle) -> ObjectInfo:
    """Size, ETag, version and Content-MD5 of the blob at ``path``: one request."""
    props = throttled_call(throttle, "HEAD", lambda: sync(fs.loop, _properties, fs, path))
    md5 = props.content_settings.content_md5
    hex_md5 = bytes(md5).hex() if md5 else None
    return ObjectInfo(
        url,
        int(props.size),
        str(props.etag).strip('"'),
        getattr(props, "version_id", None),
        Checksum("md5", hex_md5, "the blob's Content-MD5") if hex_md5 else None,
    )


def azure_gets(fs: Any, path: str, info: ObjectInfo) -> RangedGets:
    """Ranged GETs of the blob at ``path`` (for :func:`ranged_reads`), each with ``If-Match``
    on ``info.etag`` (when known): a blob changed or deleted since is an
    :class:`IntegrityError`."""

    def get(first: int, last: int) -> bytes:
        return sync(fs.loop, _read, fs, path, info, first, last - first)

    def changed(exc: Exception) -> IntegrityError | None:
        status = _status(exc)
        if info.etag is None or status not in (404, 412):
            return None
        return changed_underneath(
            info,
            noticed=f"If-Match on ETag {info.etag} failed: HTTP {status}",
            seen="another version" if status == 412 else "no blob",
        )

    return RangedGets(get, changed)


def _blob_client(fs: Any, path: str) -> Any:
    container, blob, version_id = fs.split_path(path)
    return fs.service_client.get_blob_client(container, blob), version_id


async def _properties(fs: Any, path: str) -> Any:
    client, version_id = _blob_client(fs, path)
    try:
        return await client.get_blob_properties(version_id=version_id)
    except Exception as exc:
        if _status(exc) == 404:
            raise FileNotFoundError(f"no blob {path}") from exc
        raise


async def _read(fs: Any, path: str, info: ObjectInfo, offset: int, count: int) -> bytes:
    from azure.core import MatchConditions

    client, version_id = _blob_client(fs, path)
    condition: dict[str, Any] = {}
    if info.etag is not None:
        condition = {"etag": f'"{info.etag}"', "match_condition": MatchConditions.IfNotModified}
    stream = await client.download_blob(
        offset=offset,
        length=count,
        version_id=version_id or info.version_id,
        max_concurrency=1,
        **condition,
    )
    return bytes(await stream.readall())


def _status(exc: BaseException) -> int | None:
    """The HTTP status of an Azure SDK error (``HttpResponseError.status_code``), else None."""
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


__all__ = ["AZURE_PROTOCOLS", "azure_filesystem", "azure_gets", "azure_object_info"]
