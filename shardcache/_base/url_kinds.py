"""What kind of URL a string is: its protocol, whether it is a ``pipe:`` command, the
local path a file URL names, and the S3 object version a URL pins (``?versionId=``).

Low-level on purpose: the storage side (layout, freshness, remote, retry, downloads) imports
it alone, without the spec grammar, manifests or configuration of ``_datasets.urls``.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlparse
from urllib.request import url2pathname

PIPE_PREFIX = "pipe:"
"""A URL starting with this is a shell command whose standard output is the shard."""

LOCAL_PROTOCOLS = frozenset({"file", "local"})  # protocols whose URLs name local files

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def url_scheme(url: str) -> str | None:
    """The scheme ``url`` starts with (``<scheme>://``) as written, or None."""
    match = _SCHEME_RE.match(url)
    return match.group(1) if match else None


def is_pipe_url(url: str) -> bool:
    """True for webdataset's ``pipe:<command>`` URLs (case-sensitive, as in webdataset)."""
    return url.startswith(PIPE_PREFIX)


def url_protocol(url: str) -> str:
    """The protocol of ``url`` ("s3", "gs", "http", ...), lower-cased; "file" for a path;
    "pipe" for a ``pipe:`` command."""
    if is_pipe_url(url):
        return "pipe"
    scheme = url_scheme(url)
    return scheme.lower() if scheme else "file"


def local_path(url: str) -> str:
    """The absolute path of the file a local ``url`` names, read as webdataset's ``gopen``
    reads it: a plain path (``~`` expanded, relative to the working directory), or a
    ``file:`` URL (``file:/p``, ``file:///p``, ``file://localhost/p``) with its
    percent-escapes decoded. ``file://name/p`` keeps fsspec's reading (``name/p``)."""
    if url[:5].lower() == "file:":
        parsed = urlparse(url)
        path = url2pathname(parsed.path)
        if parsed.netloc not in ("", "localhost"):
            path = parsed.netloc + path
    elif url[:8].lower() == "local://":
        path = url[8:]
    else:
        path = url
    return os.path.abspath(os.path.expanduser(path))


VERSION_QUERY = "?versionId="
"""What follows an S3 key to name one version of the object (s3fs's spelling)."""


def s3_version(path: str) -> str | None:
    """The version an S3 URL or path pins (``s3://b/k?versionId=V`` -> ``V``), else None.
    Read from the string itself: s3fs reads it only when its file system is
    ``version_aware``, and sends a plain GET of the latest version otherwise."""
    version = path.partition(VERSION_QUERY)[2]
    return version or None


def pin_version(url: str, version: str) -> str:
    """``url`` pinned to the S3 object version ``version``."""
    return f"{url.partition(VERSION_QUERY)[0]}{VERSION_QUERY}{version}"


__all__ = [
    "LOCAL_PROTOCOLS",
    "PIPE_PREFIX",
    "VERSION_QUERY",
    "is_pipe_url",
    "local_path",
    "pin_version",
    "s3_version",
    "url_protocol",
    "url_scheme",
]
