"""Google Cloud Storage through gcsfs: the file system, an object's metadata, and its bytes
read pinned to one generation.

An object's metadata (one JSON ``GET``, no listing) gives its size, its ``crc32c`` (every
GCS object has one: base64 of the big-endian CRC32C, S3's encoding), its ``md5Hash`` (not
for composite objects) and its *generation*, which changes whenever the object is
replaced. Every read of a download names that generation (``?generation=``), so a
replaced object is never stitched together: GCS answers 404 for a generation that is gone,
which is raised as :class:`IntegrityError` (the download starts over on the new object).
A server that ignores the pin (the GCS emulator) is still caught: the bytes then fail the
CRC32C check.

gcsfs's default file system (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` unset or true) asks a
gRPC API for the bucket's type before operations; shardcache makes the plain one instead
unless that variable is set to true explicitly (zonal and hierarchical-namespace buckets).
"""

from __future__ import annotations

import base64
import errno
from typing import Any

from fsspec.asyn import sync

from .._base.errors import IntegrityError
from .._base.extras import require_extras
from .._retry.throttle import Throttle, throttled_call
from .checksums import Checksum
from .download import ObjectInfo, changed_underneath
from .ranged_gets import RangedGets

GCS_PROTOCOLS = frozenset({"gs", "gcs"})


def gcs_filesystem(options: dict[str, Any], extended: bool) -> Any:
    """A gcsfs file system made with ``options``: the plain one, or gcsfs's extended one
    (zonal and hierarchical-namespace buckets: a bucket-type look-up over gRPC first) when
    ``extended``."""
    require_extras("gs:// URLs", "gcs")
    if extended:
        import fsspec

        return fsspec.filesystem("gs", **options)
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem(**options)


def gcs_object_info(fs: Any, url: str, path: str, throttle: Throttle) -> ObjectInfo:
    """Size, CRC32C, MD5 and generation of the object at ``path``: one metadata request."""
    try:
        meta = throttled_call(
            throttle, "HEAD", lambda: _forbidden_typed(sync, fs.loop, fs._get_object, path)
        )
    except FileNotFoundError as exc:
        _raise_if_no_bucket(fs, path, exc, throttle)
        raise
    crc32c = meta.get("crc32c")
    md5 = meta.get("md5Hash")
    return ObjectInfo(
        url,
        int(meta["size"]),
        str(meta.get("etag") or "") or None,
        str(meta["generation"]) if meta.get("generation") else None,
        Checksum("md5", base64.b64decode(md5).hex(), "the object's md5Hash") if md5 else None,
        checksum=Checksum("crc32c", crc32c, "the object's crc32c") if crc32c else None,
    )


def gcs_gets(fs: Any, path: str, info: ObjectInfo) -> RangedGets:
    """Ranged GETs of the object at ``path`` (for :func:`ranged_reads`), each pinned to
    ``info``'s generation: a generation that is gone is an :class:`IntegrityError`."""
    generation = info.version_id
    # fs.url gives the media URL (".../o/<key>?alt=media") in every gcsfs release; the
    # generation is added here, as only newer ones take it as an argument.
    url = fs.url(path) + (f"&generation={generation}" if generation else "")

    def get(first: int, last: int) -> bytes:
        headers = {"Range": f"bytes={first}-{last - 1}"}
        return _forbidden_typed(sync, fs.loop, fs._call, "GET", url, headers=headers)[1]

    def changed(exc: Exception) -> IntegrityError | None:
        if generation is None or not isinstance(exc, FileNotFoundError):
            return None
        return changed_underneath(
            info,
            noticed=f"generation {generation}, read pinned to it, is gone",
            expected=generation,
            seen="another generation",
        )

    return RangedGets(get, changed)


def _raise_if_no_bucket(fs: Any, path: str, missing: FileNotFoundError, throttle: Throttle) -> None:
    """Raise a ``FileNotFoundError`` coded ``NoSuchBucket`` (botocore's shape, which the retry
    policy reads) if ``path``'s bucket does not exist: gcsfs gives the same bare
    ``FileNotFoundError`` for a missing object and a missing bucket, so one more metadata
    request (made only for a missing object, in its slot of ``throttle`` and counted as a
    HEAD) tells them apart, and a warm stops at once on a missing bucket."""
    bucket = path.split("/", 1)[0]
    try:
        throttled_call(
            throttle,
            "HEAD",
            lambda: _forbidden_typed(sync, fs.loop, fs._call, "GET", "b/{}", bucket, json_out=True),
        )
    except FileNotFoundError:
        error = FileNotFoundError(errno.ENOENT, f"GCS bucket {bucket!r} does not exist")
        error.response = {  # type: ignore[attr-defined]
            "Error": {"Code": "NoSuchBucket"},
            "ResponseMetadata": {"HTTPStatusCode": 404},
        }
        raise error from missing
    except OSError:
        pass  # the bucket may exist and not be readable: the object's error stands


def _forbidden_typed(call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, gcsfs's refusal (a bare ``OSError("Forbidden: ...")``)
    raised as a ``PermissionError``, as the retry policy classifies refusals."""
    try:
        return call(*args, **kwargs)
    except PermissionError:
        raise
    except OSError as exc:
        if exc.errno is None and str(exc).startswith("Forbidden"):
            first = str(exc).splitlines()[0]
            raise PermissionError(errno.EACCES, f"GCS refused the request ({first})") from exc
        raise


__all__ = ["GCS_PROTOCOLS", "gcs_filesystem", "gcs_gets", "gcs_object_info"]
