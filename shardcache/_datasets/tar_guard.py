"""A shard's stream checked as a tar while webdataset's own tar reader reads it.

``shardcache.stage()`` hands each shard's stream to whatever expands it next, usually
``wds.tarfile_to_samples()``, whose :mod:`tarfile` raises a bare ``tarfile.ReadError`` for an
empty, non-tar or truncated shard, and ends one with a damaged header there without an error
(the rest of its samples silently missing). :class:`TarGuard` follows the tar's headers in
the bytes as they pass (one header parsed per member, nothing read twice) and raises a
:class:`~shardcache.ShardFormatError` naming the shard, what was expected, what was seen
and what to do:

- at the first read, for an empty shard or one that does not start with a tar header;
- when the stream ends inside a header, a member's data or its padding (a truncated shard:
  :mod:`tarfile` raises ``ReadError`` for a missing padding too);
- at a damaged header after the first member.

A tar that ends at a member boundary without its end-of-archive blocks is complete, as
:mod:`tarfile` and :mod:`.tar_members` read it. A compressed shard is checked once
decompressed (:mod:`.decompressed` comes first). Past the end-of-archive block, a seek, or
a header not followed here (GNU sparse, global pax), the bytes pass unchecked. After an
error the stream reads as ended, so a handler that skips the shard is called once.
"""

from __future__ import annotations

import zlib
from typing import Any, BinaryIO

from .._base.errors import ShardFormatError
from .tar_members import (
    ADVICE,
    BLOCK,
    member_size,
    pax_records,
    pax_size,
    refuse_start,
)

_NO_DATA = frozenset(b"123456")  # links, devices, directories, FIFOs: no data follows
_EXTENSIONS = frozenset(b"xXLK")  # a pax or GNU long-name header: the member follows
_UNFOLLOWED = frozenset(b"Sg")  # GNU sparse maps, global pax headers: the rest passes unchecked
_ZERO_BLOCK = bytes(BLOCK)
_SPACES = b" " * 8  # the checksum field, as it is summed
_MAX_EXTENSION = 1 << 20  # larger extension data is not followed: the rest passes unchecked


class TarGuard:
    """``stream`` (a shard named ``url``) read through, its tar structure checked."""

    def __init__(self, stream: BinaryIO, url: str) -> None:
        self._stream = stream
        self._url = url
        self._position = 0  # bytes read so far
        self._next = 0  # where the next header (or an extension's data) starts
        self._need = BLOCK  # its length
        self._pending = b""  # its bytes read so far
        self._extension: int | None = None  # the kind of the extension whose data is next
        self._member = 0  # where the current member's first header starts
        self._pax_size: int | None = None  # a pax header's size for the next member
        self._after_extension = False  # the header before was an extension's
        self._checking = True
        self._failed = False

    def read(self, size: int = -1) -> bytes:
        if self._failed:
            return b""
        data = self._stream.read(size)
        if not self._checking:
            return data
        end = self._position + len(data)
        if data and end <= self._next:  # within a member's data: nothing to parse
            self._position = end
            return data
        try:
            if data:
                self._follow(data)
            elif size != 0:
                self._ended()
        except ShardFormatError:
            self._failed = True
            raise
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        self._checking = False  # the reader left the sequence of headers: not followed
        return self._stream.seek(offset, whence)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __str__(self) -> str:
        return str(self._stream)

    def _follow(self, data: bytes) -> None:
        """Parse every header (and extension's data) that ends within ``data``."""
        start = self._position
        end = self._position = start + len(data)
        while self._checking and self._next < end:
            first, last = self._next - start, self._next + self._need - start
            if self._pending or first < 0 or last > len(data):  # split across reads
                self._pending += data[max(first + len(self._pending), 0) : last]
                if len(self._pending) < self._need:
                    return  # the rest comes with the next read
                block, self._pending = self._pending, b""
            else:
                block = data[first:last]
            if self._extension is None:
                self._header(block)
            else:
                self._extension_data(block)

    def _header(self, block: bytes) -> None:
        at = self._next
        if block == _ZERO_BLOCK:
            self._checking = False  # the end-of-archive block (first: an empty tar)
            drain = getattr(self._stream, "drain", None)
            if drain is not None:
                drain()  # a compressed shard's end (its check) is read too
            return
        if not _checksum_matches(block):
            if at == 0:
                refuse_start(block, self._url)
            raise ShardFormatError(
                f"{self._where(at)}: not a tar header (its checksum does not match); expected "
                f"the member after byte {self._member} to start here. The shard is damaged. "
                f"{ADVICE}.",
                where=self._where(at),
            )
        kind = block[156]
        if kind in _UNFOLLOWED:
            self._checking = False
            return
        if not self._after_extension:
            self._member = at  # a member's first header (its extension headers come first)
        size = member_size(block, self._where(at))
        if kind in _EXTENSIONS:
            padded = -(-size // BLOCK) * BLOCK
            if padded > _MAX_EXTENSION:
                self._checking = False
                return
            self._after_extension = True
            self._next = at + BLOCK
            if padded:
                self._extension, self._need = kind, padded
            return
        self._after_extension = False
        if self._pax_size is not None:
            size, self._pax_size = self._pax_size, None
        if kind in _NO_DATA:
            size = 0
        self._next = at + BLOCK + -(-size // BLOCK) * BLOCK

    def _extension_data(self, data: bytes) -> None:
        if self._extension in b"xX":
            records = pax_records(data, self._where(self._next))
            if "size" in records:
                self._pax_size = pax_size(records["size"], self._where(self._next))
        self._next += self._need
        self._extension, self._need = None, BLOCK

    def _ended(self) -> None:
        """The stream ended: raise if it ended inside a header, a member's data or padding,
        or after an extension header (the member it is for missing)."""
        if self._next == 0:
            refuse_start(self._pending, self._url)  # empty, or shorter than a header
        if self._pending or self._after_extension or self._position < self._next:
            raise ShardFormatError(
                f"{self._url}: the shard ends after {self._position} bytes, inside the tar "
                f"member whose header starts at byte {self._member}: it is truncated; "
                f"expected a complete tar file. {ADVICE}.",
                where=self._url,
            )

    def _where(self, at: int) -> str:
        return f"{self._url} at byte {at}"


def _checksum_matches(header: bytes) -> bool:
    """Whether ``header``'s checksum field holds the sum of its bytes (the field counted as
    spaces), as :mod:`tarfile` checks it. The sum is zlib's Adler-32 ``A`` (one C call, not a
    Python loop over 512 bytes): it is compared modulo 65521, which only a change of 257
    bytes or more could pass unseen."""
    field = header[148:156].split(b"\0", 1)[0].strip()
    try:
        stored = int(field, 8)
    except ValueError:
        return False
    summed = zlib.adler32(header[156:], zlib.adler32(_SPACES, zlib.adler32(header[:148])))
    return summed & 0xFFFF == (1 + stored) % 65521
