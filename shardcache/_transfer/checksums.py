"""Content checksums: which one verifies a download, and computing it cheaply.

S3 keeps an *additional checksum* of most objects (CRC64NVME by default since 2024-12, or
the CRC32 / CRC32C / SHA1 / SHA256 the uploader chose, and the newer SHA512, MD5 and
XXHASH64 / XXHASH3 / XXHASH128 where the SDK knows them); ``HeadObject`` with
``ChecksumMode=ENABLED`` returns it. A *full-object* one is a checksum of the object's
bytes and verifies a download as well as the ETag's MD5 does against corruption in
transit, at a fraction of the CPU: CRC64NVME, CRC32C and the xxHashes run in ``awscrt``'s
C code (~6-9 GB/s here for the CRCs), CRC32 in zlib (~2.5 GB/s), SHA in hashlib
(~1.6 GB/s), MD5 at ~0.6 GB/s. A *composite* one (a checksum of the parts' checksums of
a multipart upload) is checked over the parts (:mod:`~shardcache._transfer.multipart`).

:func:`expected` picks what a download is verified against: the cheapest checksum the
store describes, else nothing beyond the size.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from awscrt import checksums as _crt

from .._base.errors import IntegrityError

# xxHashes arrived in awscrt after shardcache's lowest supported version: without them,
# an object described by one alone is checked by what else describes it.
_XXHASHES: dict[str, Callable[[], Any]] = (
    {
        "xxhash3": _crt.XXHash.new_xxhash3_64,
        "xxhash64": _crt.XXHash.new_xxhash64,
        "xxhash128": _crt.XXHash.new_xxhash3_128,
    }
    if hasattr(_crt, "XXHash")
    else {}
)

# S3's additional checksums, cheapest to compute first (HeadObject returns at most one).
S3_ALGORITHMS = (
    "crc64nvme",
    "crc32c",
    *_XXHASHES,
    "crc32",
    "sha1",
    "sha256",
    "sha512",
    "md5",
)


MESH_CRC = "crc32c"
"""The checksum every download records of its bytes (``mesh_crc32c``), whatever the store's:
peers of the cache mesh check a copy against it (as fast as any, present for size-only
stores)."""


@dataclass(frozen=True)
class Checksum:
    """A checksum of an object's content, as the store reports it.

    ``value`` is in the store's own encoding: base64 of the big-endian digest for S3's
    additional checksums (and GCS's CRC32C), lowercase hex for ``md5``. ``parts`` is None
    for a checksum of the object's bytes; for a multipart upload's checksum (an ETag
    ``<md5>-N``, a ``COMPOSITE`` S3 checksum ``<value>-N``) it is N, and ``value`` is the
    checksum of the N parts' digests joined, without the ``-N``."""

    algorithm: str  # one of S3_ALGORITHMS, or "md5"
    value: str
    source: str  # where the value came from, for messages ("the ETag", "x-amz-checksum-crc32")
    parts: int | None = None

    @property
    def method(self) -> str:
        """How a copy checked against it was verified, as records and counts name it:
        the algorithm, ``-parts`` added for a multipart upload's checksum."""
        return self.algorithm if self.parts is None else f"{self.algorithm}-parts"

    def as_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"algorithm": self.algorithm, "value": self.value}
        if self.parts is not None:
            record["parts"] = self.parts
        return record


class Hasher:
    """A running checksum of one algorithm; :meth:`value` encodes it like the store."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        crc = _CRCS.get(algorithm)
        if crc is not None:
            self._crc: Callable[[Any, int], int] | None = crc[0]
            self._width = crc[1]
            self._state = 0
        else:
            self._crc = None
            make = _XXHASHES.get(algorithm)
            self._hash = (
                _Finalized(make()) if make else hashlib.new(algorithm, usedforsecurity=False)
            )

    def update(self, data: Any) -> None:
        """Add ``data`` (any bytes-like object: bytes, bytearray, memoryview)."""
        if self._crc is not None:
            self._state = self._crc(data, self._state)
        else:
            self._hash.update(data)

    def extend(self, other: Hasher, length: int) -> None:
        """Become the checksum of this hasher's bytes followed by ``other``'s ``length``
        bytes, without reading them again (CRCs only: :func:`combinable`)."""
        self._state = _COMBINE[self.algorithm](self._state, other._state, length)

    def digest(self) -> bytes:
        """The raw checksum (big-endian for CRCs): what a multipart upload's checksum joins."""
        if self._crc is not None:
            return self._state.to_bytes(self._width, "big")
        return self._hash.digest()

    def value(self) -> str:
        if self.algorithm == "md5":
            return self.digest().hex()
        return base64.b64encode(self.digest()).decode()


class _Finalized:
    """An awscrt xxHash behind hashlib's ``update``/``digest`` (its digest can be asked twice)."""

    def __init__(self, crt_hash: Any) -> None:
        self._crt_hash = crt_hash
        self._digest: bytes | None = None

    def update(self, data: Any) -> None:
        self._crt_hash.update(data)

    def digest(self) -> bytes:
        if self._digest is None:
            self._digest = bytes(self._crt_hash.finalize())
        return self._digest


_CRCS: dict[str, tuple[Callable[[Any, int], int], int]] = {
    "crc64nvme": (_crt.crc64nvme, 8),
    "crc32c": (_crt.crc32c, 4),
    "crc32": (zlib.crc32, 4),
}


# CRCs of two pieces combine into the CRC of both (awscrt >= 0.31): the parts of a parallel
# download are hashed as they arrive and combined, with no second pass over the file.
_COMBINE: dict[str, Callable[[int, int, int], int]] = {
    "crc64nvme": _crt.combine_crc64nvme,
    "crc32c": _crt.combine_crc32c,
    "crc32": _crt.combine_crc32,
}


def combinable(algorithm: str) -> bool:
    """Whether checksums of ``algorithm`` over pieces combine (:meth:`Hasher.extend`)."""
    return algorithm in _COMBINE


def from_s3_head(head: Mapping[str, Any], *, multipart_etag: bool) -> Checksum | None:
    """The additional checksum in a ``HeadObject`` or whole-object ``GetObject`` response
    (with ``ChecksumMode``), or None. A full-object one checks the bytes; a composite one
    (``ChecksumType: COMPOSITE``, or a ``-N`` suffix) has ``parts`` set. On a multipart
    upload (``multipart_etag``) a checksum of unknown type without ``-N`` is ignored: only
    an explicit ``FULL_OBJECT`` says it covers the bytes themselves (a single PUT's
    checksum always does)."""
    kind = head.get("ChecksumType")
    for algorithm in S3_ALGORITHMS:
        raw = head.get(f"Checksum{algorithm.upper()}")
        if not isinstance(raw, str) or not raw:
            continue
        value, parts = _split_parts(raw)
        if algorithm == "md5":  # base64 here; an MD5 is kept in hex (as an ETag gives it)
            value = base64.b64decode(value).hex()
        source = f"x-amz-checksum-{algorithm}"
        if parts is not None and kind in (None, "COMPOSITE"):
            return Checksum(algorithm, value, source, parts=parts)
        if parts is None and (kind == "FULL_OBJECT" or (kind is None and not multipart_etag)):
            return Checksum(algorithm, value, source)
        return None
    return None


def _split_parts(value: str) -> tuple[str, int | None]:
    """``("abc", 5)`` for ``"abc-5"`` (a multipart upload's checksum), ``("abc", None)``
    for ``"abc"``."""
    head, sep, tail = value.rpartition("-")
    if sep and head and tail.isdigit() and int(tail) > 0:
        return head, int(tail)
    return value, None


def expected(info: Any, verify: str) -> Checksum | None:
    """What a download of ``info`` (an :class:`~shardcache._transfer.download.ObjectInfo`) is
    verified against beyond its size under ``verify`` (``size``: nothing). The cheapest the
    store describes: a full-object checksum, the ETag's MD5 of a single-part upload, a
    composite checksum of a multipart one, the ETag's MD5 of the parts' MD5s."""
    if verify == "size":
        return None
    described = [c for c in (info.checksum, info.md5_checksum) if c is not None]
    # A checksum of the bytes before one of the parts (no layout to learn), a store's
    # CRC or SHA before an MD5 (cheaper to compute).
    described.sort(key=lambda c: (c.parts is not None, c.algorithm == "md5"))
    return described[0] if described else None


def etag_checksum(etag: str | None) -> Checksum | None:
    """The MD5 an S3 ETag is, when it has the form of one: 32 hex digits (a single-part
    upload) or 32 hex digits and ``-N`` (the MD5 of the N parts' MD5s). Whether the store
    promises the ETag is an MD5 at all is the caller's to judge (encryption, bucket kind)."""
    if not etag:
        return None
    value, parts = _split_parts(etag)
    if not _MD5_HEX.match(value):
        return None
    return Checksum("md5", value, "the ETag", parts=parts)


_MD5_HEX = re.compile(r"^[0-9a-f]{32}$")


def mismatch(
    url: str,
    want: Checksum,
    digest: str | None,
    attempt: int,
    *,
    which: str = "",
    parts: list[int] | None = None,
) -> IntegrityError:
    """The error of a download whose ``digest`` is not ``want``; ``which`` says which parts
    of a multipart upload differ (``parts``: their numbers), where that is known."""
    if want.parts is None:
        what = f"{want.algorithm.upper()} of the downloaded bytes"
    else:
        what = f"{want.algorithm.upper()} of the {want.parts} parts' {want.algorithm.upper()}s"
    hint = (
        "set SHARDCACHE_ETAG_MD5=off if this store's ETags are not MD5s"
        if want.source == "the ETag"
        else "check that the store computes this checksum over the object's bytes"
    )
    return IntegrityError(
        f"{url}: {what} is {digest}, expected {want.value} ({want.source}) on attempt "
        f"{attempt}{'; ' + which if which else ''}. The bytes were corrupted in transit or "
        "the object changed; nothing was published. Check the network path (proxies) and "
        f"the object; {hint}.",
        url=url,
        attempts=attempt,
        expected=want.value,
        seen=digest,
        algorithm=want.method,
        parts=parts or [],
    )


__all__ = [
    "S3_ALGORITHMS",
    "Checksum",
    "Hasher",
    "combinable",
    "etag_checksum",
    "expected",
    "from_s3_head",
    "mismatch",
]
