"""The drop-in stage's tar expansion: webdataset's samples, parsed by :mod:`.tar_members`.

webdataset expands a shard with :mod:`tarfile` in stream mode (``tar_file_expander``, then
``group_by_keys``): about 90 us of CPU a sample of 100 kB here, spent between two steps by a
loop that reads in its own thread. :mod:`.tar_members` parses the same headers (ustar, GNU
long names, pax) in about a quarter of that, and the stage's whole work a sample drops to
about a third (B1). The samples are webdataset's: the same keys
(webdataset's split, suffixes lower-cased), ``__meta__`` members skipped, ``select_files``
and ``rename_files`` applied as webdataset applies them, ``__url__`` and ``__local_path__``
set, keys in webdataset's order; an error goes to the handler with the stream and URL added
to its ``args``, and a handler that returns False ends the stream.

A compressed tar (gzip, bzip2, xz) is expanded by webdataset itself; what its
:mod:`tarfile` raises on a damaged one (``tarfile.ReadError``, ``EOFError``, ...) reaches the
handler as a :class:`~shardcache.ShardFormatError` naming the shard. An empty file, a file
too short for a tar header and a file that is not a tar at all are a ``ShardFormatError``
(webdataset: ``tarfile.ReadError``).

A shard's last sample is delivered once its stream was read to the end: a shard read while
it downloads ends only once verified (:mod:`shardcache._store.growing`), so the last sample
follows the verdict, and a failed verification keeps it back (its error goes to the
handler).

Two differences, both on damaged shards, both so that nothing is lost unseen:

- A damaged header after the first member: :mod:`tarfile` ends the archive there without
  an error, and the shard's remaining samples are silently missing; here the sample being
  assembled is delivered as webdataset delivers it, then a
  :class:`~shardcache.ShardFormatError` goes to the handler.
- A suffix repeated within a sample: webdataset gives the handler a ``ValueError`` and may
  go on with the shard's next member; here it is a ``ShardFormatError`` and, as with every
  error within a shard, the rest of the shard is skipped when the handler returns True.
"""

from __future__ import annotations

import lzma
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import webdataset as wds

from .._base.errors import ShardCacheError, ShardFormatError
from .tar_members import ADVICE, BLOCK, Sample, compression, samples

Handler = Callable[[BaseException], bool]


class _Replayed:
    """``stream`` with ``head`` (its first bytes, already read) put back in front."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        self._head = head
        self._stream = stream

    def read(self, size: int = -1) -> bytes:
        head = self._head
        if not head:
            return self._stream.read(size)
        if 0 <= size <= len(head):
            self._head = head[size:]
            return head[:size]
        self._head = b""
        rest = self._stream.read(-1 if size < 0 else size - len(head))
        return head + rest if rest else head

    def __str__(self) -> str:
        return str(self._stream)


def expand(
    shards: Iterable[dict[str, Any]],
    handler: Handler,
    select_files: Callable[[str], bool] | None = None,
    rename_files: Callable[[str], str] | None = None,
) -> Iterator[dict[str, Any]]:
    """The samples of ``shards`` (``{"url", "stream", "local_path"}`` dicts), as
    ``wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander(shards, ...))``
    gives them."""
    stopped = False

    def handle(exn: BaseException) -> bool:
        nonlocal stopped
        keep = handler(exn)
        stopped = stopped or not keep
        return keep

    for shard in shards:
        stream = shard["stream"]
        try:
            head = stream.read(BLOCK)
        except Exception as exn:
            _report(exn, shard, handle)
        else:
            kind = compression(head)
            if kind is None:
                yield from _parsed(
                    _Replayed(head, stream), shard, handle, select_files, rename_files
                )
            else:
                replayed = {**shard, "stream": _Replayed(head, stream)}
                named = _named_errors(handle, shard["url"], kind)
                files = wds.tariterators.tar_file_expander(
                    [replayed], handler=named, select_files=select_files, rename_files=rename_files
                )
                yield from wds.tariterators.group_by_keys(files, handler=named)
        if stopped:
            return


def _parsed(
    stream: _Replayed,
    shard: dict[str, Any],
    handle: Handler,
    select_files: Callable[[str], bool] | None,
    rename_files: Callable[[str], str] | None,
) -> Iterator[dict[str, Any]]:
    """One shard's samples, parsed here, each as soon as the next one starts (as webdataset
    yields them). The last is held back until the stream was read to its end: a shard read
    while it downloads ends only once verified, so its last sample follows the verdict, and
    a failed verification keeps it back (the error goes to the handler). A damaged shard
    delivers the samples before the damage, then its error."""
    url, local_path = shard["url"], shard.get("local_path")
    last: Sample | None = None  # the archive's end (or its damage) came after it
    try:
        for sample in samples(
            stream, 0, url, rename=rename_files, select=select_files, deliver_before_damage=True
        ):
            if sample.end < 0:
                last = sample
            else:
                yield _as_webdataset_sample(sample, url, local_path)
    except Exception as exn:
        if last is not None:
            yield _as_webdataset_sample(last, url, local_path)
        _report(exn, shard, handle)
        return
    try:
        while stream.read(1 << 20):
            pass  # the end-of-archive record, then the end of file (the verdict)
    except Exception as exn:
        _report(exn, shard, handle)
        return
    if last is not None:
        yield _as_webdataset_sample(last, url, local_path)


# What tarfile and the decompressors raise on a damaged compressed tar.
_FORMAT_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)


def _named_errors(handle: Handler, url: str, kind: str) -> Handler:
    """``handle``, given a :class:`ShardFormatError` naming ``url`` for what webdataset's
    tar expansion raises on a damaged ``kind``-compressed shard (an ``OSError`` from the
    stream, a failed download or verification, passes as it is)."""

    def named(exn: BaseException) -> bool:
        if isinstance(exn, ShardCacheError) or not isinstance(exn, (*_FORMAT_ERRORS, OSError)):
            return handle(exn)
        cause = exn.args[0] if exn.args else type(exn).__name__
        error = ShardFormatError(
            f"{url}: the {kind}-compressed tar cannot be read ({type(exn).__name__}: "
            f"{cause}); expected a complete {kind}-compressed tar file. {ADVICE}.",
            where=url,
        )
        error.__cause__ = exn
        return handle(error)

    return named


def _report(exn: Exception, shard: dict[str, Any], handle: Handler) -> None:
    """``exn`` to the handler, its ``args`` extended as webdataset extends them."""
    exn.args = (*exn.args, shard["stream"], shard["url"])
    handle(exn)


def _as_webdataset_sample(sample: Sample, url: str, local_path: str | None) -> dict[str, Any]:
    """``sample`` as webdataset's ``group_by_keys`` builds it, keys in its order."""
    out: dict[str, Any] = {"__key__": sample.key, "__url__": url}
    for number, (suffix, data) in enumerate(sample.files.items()):
        out[suffix] = data
        if number == 0 and local_path is not None:
            out["__local_path__"] = local_path
    return out
