"""A compressed shard's stream, decompressed as it is read, every decompression error a
:class:`~shardcache.ShardFormatError`.

webdataset's :mod:`tarfile` (mode ``r|*``) recognises a gzip, bzip2, xz or lzma-compressed
tar by its first bytes and decompresses it itself; a truncated or damaged one then raises
``zlib.error``, ``EOFError`` or ``tarfile.ReadError``, or ends early without an error, and
gzip's CRC is never checked. :class:`Opened` recognises the same first bytes and returns the
decompressed tar, so the tar check (:mod:`.tar_guard`, :mod:`.tar_members`) applies to it.
The decompressor checks each gzip member's CRC and length, xz's check and bzip2's CRCs. A
stream that ends before the compressed data's end is a truncated shard. Concatenated
compressed members (``cat a.gz b.gz``) are read one after the other, as :mod:`gzip` and
``tar xzf`` read them (webdataset's :mod:`tarfile` reads the first only); zero bytes after
a member are ignored, as :mod:`gzip` ignores them, and other bytes there are an error.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from typing import Any, BinaryIO, Protocol

from .._base.errors import ShardFormatError
from .tar_members import ADVICE

_CHUNK = 1 << 16  # compressed bytes read at a time
_HEAD = 10  # enough of a stream's first bytes to recognise its compression
_LIMIT = 1 << 18  # decompressed bytes made at a time (a highly compressed shard stays bounded)
_ZLIB = type(zlib.decompressobj())


class _Decompressor(Protocol):
    eof: bool
    unused_data: bytes

    def decompress(self, data: bytes, max_length: int = -1) -> bytes: ...


def _kind(head: bytes) -> str | None:
    """The compression :mod:`tarfile` (``r|*``) detects at ``head``, if any."""
    if head.startswith(b"\x1f\x8b\x08"):
        return "gzip"
    if head[:3] == b"BZh" and head[4:10] == b"1AY&SY":
        return "bzip2"
    if head.startswith((b"\x5d\x00\x00\x80", b"\xfd7zXZ")):
        return "xz"
    return None


def _decompressor(kind: str) -> _Decompressor:
    if kind == "gzip":
        return zlib.decompressobj(wbits=31)  # type: ignore[return-value]
    if kind == "bzip2":
        return bz2.BZ2Decompressor()  # type: ignore[return-value]
    return lzma.LZMADecompressor()  # type: ignore[return-value]


_ERRORS = (zlib.error, OSError, lzma.LZMAError, EOFError, ValueError)


class Opened:
    """``stream`` (a shard named ``url``), decompressed as it is read if its first bytes
    are a compression :mod:`tarfile` recognises, as it is otherwise. Nothing is read until
    the first ``read``."""

    def __init__(self, stream: BinaryIO, url: str) -> None:
        self._stream = stream
        self._url = url
        self._inner: BinaryIO | Decompressed | None = None
        self._head = b""  # an uncompressed stream's first bytes, not returned yet

    def read(self, size: int = -1) -> bytes:
        if self._inner is None:
            head = b""
            while len(head) < _HEAD and (more := self._stream.read(_HEAD - len(head))):
                head += more  # a stream may return fewer bytes than asked for
            kind = _kind(head)
            if kind is None:
                self._inner, self._head = self._stream, head
            else:
                self._inner = Decompressed(self._stream, self._url, kind, head)
        head = self._head
        if not head:
            self.read = self._inner.read  # type: ignore[method-assign]  # one call less a read
            return self._inner.read(size)
        if 0 <= size < len(head):
            self._head = head[size:]
            return head[:size]
        self._head = b""
        rest = self._inner.read(-1 if size < 0 else size - len(head)) if size else b""
        return head + rest if rest else head

    def drain(self) -> None:
        """Read a compressed stream to its end, the data discarded (the tar in it ended):
        a truncated or damaged end (gzip's CRC, xz's check) raises here."""
        if isinstance(self._inner, Decompressed):
            while self._inner.read(_LIMIT):
                pass

    def __getattr__(self, name: str) -> Any:
        if name == "seek":
            raise AttributeError(name)  # its first bytes were read: it does not seek
        return getattr(self._stream, name)

    def __str__(self) -> str:
        return str(self._stream)


class Decompressed:
    """``stream`` (a ``kind``-compressed shard named ``url`` whose first bytes ``head``
    were read already), read decompressed."""

    def __init__(self, stream: BinaryIO, url: str, kind: str, head: bytes = b"") -> None:
        self._stream = stream
        self._url = url
        self._kind = kind
        self._input = head  # compressed bytes not given to the decompressor yet
        self._decompressor = _decompressor(kind)
        self._out = b""  # decompressed bytes, returned up to ``_pos``
        self._pos = 0
        self._made = 0  # decompressed bytes made so far
        self._consumed = len(head)  # compressed bytes read from the stream
        self._stream_ended = False
        self._done = False  # the compressed data ended where it should
        self._failed = False

    def read(self, size: int = -1) -> bytes:
        if self._failed:
            return b""
        pieces: list[bytes] = []
        wanted = size  # < 0: all
        try:
            while True:
                out, at = self._out, self._pos
                if at < len(out):
                    if 0 <= wanted <= len(out) - at:
                        self._pos = at + wanted
                        pieces.append(out[at : at + wanted])
                        break
                    pieces.append(out[at:] if at else out)
                    self._pos = len(out)
                    wanted -= len(out) - at if wanted > 0 else 0
                elif wanted == 0 or self._done:
                    break
                if not self._done:
                    self._out, self._pos = self._more(), 0
        except ShardFormatError:
            self._failed = True
            raise
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _more(self) -> bytes:
        """The next decompressed bytes (b"" at the end: ``_done`` set)."""
        decompressor = self._decompressor
        if decompressor.eof:
            self._input = decompressor.unused_data + self._input
            while not self._input.strip(b"\0"):  # zero padding after a member is ignored
                self._input = self._read()
                if not self._input:
                    self._done = True  # ended after a whole member
                    if not self._made:
                        raise ShardFormatError(
                            f"{self._url}: the {self._kind}-compressed shard holds 0 bytes "
                            f"once decompressed; expected a tar file in it. {ADVICE}.",
                            where=self._url,
                        )
                    return b""
            self._decompressor = decompressor = _decompressor(self._kind)  # the next member
        zlib_kind = isinstance(decompressor, _ZLIB)
        data = decompressor.unconsumed_tail + self._input if zlib_kind else self._input  # type: ignore[attr-defined]
        self._input = b""
        # bz2 and lzma keep the input they did not use; with none, they may hold output
        if not data and (zlib_kind or decompressor.needs_input):  # type: ignore[attr-defined]
            data = self._read()
            if not data:
                return self._ended(decompressor)
        try:
            made = decompressor.decompress(data, _LIMIT)
        except _ERRORS as exn:
            raise ShardFormatError(
                f"{self._url}: the {self._kind}-compressed data is damaged near compressed "
                f"byte {self._consumed} ({type(exn).__name__}: {exn}); expected a complete "
                f"{self._kind}-compressed tar file. {ADVICE}.",
                where=self._url,
            ) from exn
        self._made += len(made)
        return made

    def _read(self) -> bytes:
        data = self._stream.read(_CHUNK)
        self._consumed += len(data)
        return data

    def _ended(self, decompressor: _Decompressor) -> bytes:
        """The stream ended before the compressed data did: what the decompressor still
        holds, then (at the next call) a ShardFormatError."""
        if not self._stream_ended and isinstance(decompressor, _ZLIB):
            self._stream_ended = True
            held = decompressor.flush()
            if held:
                return held
        raise ShardFormatError(
            f"{self._url}: the compressed data ends after {self._consumed} bytes, before its "
            f"end: it is truncated; expected a complete {self._kind}-compressed tar file. "
            f"{ADVICE}.",
            where=self._url,
        )

    def __getattr__(self, name: str) -> Any:
        if name == "seek":
            raise AttributeError(name)  # a decompressed stream does not seek
        return getattr(self._stream, name)

    def __str__(self) -> str:
        return str(self._stream)
