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

A compressed tar (gzip, bzip2, xz or lzma, as webdataset's :mod:`tarfile` recognises them)
is decompressed by :mod:`.decompressed` and parsed the same way; a truncated or damaged one
is a :class:`~shardcache.ShardFormatError` naming the shard (webdataset: ``zlib.error``,
``EOFError``, ``tarfile.ReadError``, or samples silently missing). An empty file, a file
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

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .decompressed import Opened
from .tar_members import Sample, samples

Handler = Callable[[BaseException], bool]


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
        yield from _parsed(
            Opened(shard["stream"], shard["url"]), shard, handle, select_files, rename_files
        )
        if stopped:
            return


def _parsed(
    stream: Opened,
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
