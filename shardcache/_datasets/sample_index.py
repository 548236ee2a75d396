"""Where each sample of a shard starts: what a sample-level epoch split needs to know.

An equal split of an epoch between consumers (:mod:`shardcache._datasets.epoch_split`) needs every
shard's sample count, and where each sample starts so that a consumer can read a range of
a shard. A tar has no table of contents, so this is learned by reading the headers of the
whole archive once (:func:`scan`), from one of two places:

* an **index file** (``shardcache index SPEC -o FILE``, read with ``index=FILE``): one JSON
  document for a shard list, each shard's size, ETag and sample offsets. It is checked
  against the shard list when loaded (every shard must be in it) and against each shard
  when the shard is read (a sample must start at every recorded offset and the archive must
  end where the record ends: otherwise the shard changed and :class:`SampleIndexError`
  says to index again);
* **learned** (the default, nothing prepared): each shard is fetched through the cache
  and scanned (:func:`learn`; which shards each rank learns, and how the job shares them
  and keeps the whole index, is :mod:`shardcache._datasets.job_index`); the result is
  kept beside the cached copy in ``<scope>/.samples/`` and reused while that copy (its
  inode and size) is the one cached, so other processes and later epochs read a small
  record instead of scanning again.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from .._base.errors import SampleIndexError, ShardCacheError
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._disk.metadata import read_meta, write_record
from .tar_members import Sample, samples

logger = get_logger(__name__)

FORMAT = "shardcache.samples"
VERSION = 1
_RECORD_LIMIT = 1 << 28  # a learned record of a shard of millions of samples still fits


@dataclass(frozen=True)
class ShardSamples:
    """One shard's samples: the byte offset each starts at, and the shard it was read from
    (size and, for remote shards, ETag)."""

    starts: tuple[int, ...]
    size: int
    etag: str | None = None

    @property
    def count(self) -> int:
        return len(self.starts)

    def as_json(self, url: str) -> dict[str, Any]:
        return {"url": url, "size": self.size, "etag": self.etag, "starts": list(self.starts)}

    @classmethod
    def from_json(cls, record: Mapping[str, Any], where: str) -> ShardSamples:
        try:
            starts = tuple(int(s) for s in record["starts"])
            size = int(record["size"])
            etag = record.get("etag")
        except (KeyError, TypeError, ValueError) as exc:
            raise SampleIndexError(
                f"{where}: a shard record is damaged ({type(exc).__name__}: {exc}); expected "
                "url, size and starts (a list of byte offsets). Make the index again with "
                "shardcache index",
                path=where,
                seen=str(record)[:200],
            ) from None
        if any(b <= a for a, b in itertools.pairwise(starts)) or any(s < 0 for s in starts[:1]):
            raise SampleIndexError(
                f"{where}: the sample offsets of {record.get('url')!r} are not increasing; "
                "the index is damaged. Make it again with shardcache index",
                path=where,
                url=record.get("url"),
            )
        return cls(starts, size, etag if isinstance(etag, str) else None)


SampleIndex = dict[str, ShardSamples]  # url -> its samples


def scan(path: str | os.PathLike[str], url: str, etag: str | None = None) -> ShardSamples:
    """Read the tar headers of the local file ``path`` (a copy of ``url``)."""
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        starts = tuple(sample.offset for sample in samples(stream, 0, url))
    return ShardSamples(starts, size, etag)


# -- index files -----------------------------------------------------------------------


def index_document(index: Mapping[str, ShardSamples], urls: Sequence[str]) -> dict[str, Any]:
    """The JSON document of an index file over ``urls`` (in that order)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "shards": [index[url].as_json(url) for url in urls],
    }


def write_index(target: str, document: Mapping[str, Any]) -> None:
    """Write an index document to a local path (atomically) or any fsspec URL."""
    data = json.dumps(document, separators=(",", ":"))
    if "://" in target and not target.startswith("file://"):
        with fsspec.open(target, "w") as out:
            out.write(data)
        return
    path = Path(target.removeprefix("file://"))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SampleIndexError(
            f"cannot write the sample index {target}: {exc.strerror or exc}; choose a "
            "writable path with -o",
            path=target,
        ) from None


def load_index(source: str, urls: Sequence[str]) -> SampleIndex:
    """The records of ``urls`` from the index file ``source`` (a path or fsspec URL)."""
    try:
        with fsspec.open(source, "r") as stream:
            document = json.load(stream)
    except FileNotFoundError:
        raise SampleIndexError(
            f"the sample index {source} does not exist; make it with "
            f"`shardcache index SPEC -o {source}`, or leave index= unset to learn it",
            path=source,
        ) from None
    except ValueError as exc:
        raise SampleIndexError(
            f"the sample index {source} is not JSON ({exc}); it is damaged: make it again "
            "with shardcache index",
            path=source,
        ) from None
    except OSError as exc:
        raise SampleIndexError(
            f"cannot read the sample index {source}: {exc}", path=source
        ) from None
    return index_records(document, source, urls)


def index_records(document: Any, source: str, urls: Sequence[str]) -> SampleIndex:
    """The records of ``urls`` in the index document ``document`` read from ``source``."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        seen = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise SampleIndexError(
            f"{source} is not a shardcache sample index (format {seen!r}, expected "
            f"{FORMAT!r}); make one with shardcache index",
            path=source,
            expected=FORMAT,
            seen=seen,
        )
    if document.get("version") != VERSION:
        raise SampleIndexError(
            f"{source} is a sample index of version {document.get('version')!r}; this "
            f"shardcache reads version {VERSION}. Make it again with this version's "
            "shardcache index",
            path=source,
            expected=VERSION,
            seen=document.get("version"),
        )
    records = {str(r.get("url")): r for r in document.get("shards") or [] if isinstance(r, dict)}
    missing = [url for url in urls if url not in records]
    if missing:
        raise SampleIndexError(
            f"the sample index {source} does not cover this shard list: {len(missing)} of "
            f"{len(urls)} shards are not in it (first: {missing[0]!r}; it holds "
            f"{len(records)} shards). It was made for another shard list: index this one "
            "with shardcache index",
            path=source,
            missing=len(missing),
            first_missing=missing[0],
        )
    return {url: ShardSamples.from_json(records[url], source) for url in urls}


# -- learning through the cache ----------------------------------------------------------


def learn(
    urls: Sequence[str],
    cache: ShardCache,
    *,
    threads: int,
    handler: Callable[[BaseException], bool] | None = None,
    on_done: Callable[[str], None] | None = None,
) -> SampleIndex:
    """Every shard's samples, fetched through ``cache`` and scanned (``threads`` at a time),
    or read from the record a scan left beside the cached copy.

    A shard that cannot be fetched or read goes to ``handler`` (webdataset's convention):
    True leaves it out of the epoch (recorded as holding no sample), anything else raises.
    """
    found: SampleIndex = {}
    failed: dict[str, ShardCacheError] = {}

    def one(url: str) -> None:
        try:
            found[url] = cached_samples(cache, url)
        except (ShardCacheError, OSError) as exc:
            if handler is None:
                raise
            failed[url] = exc if isinstance(exc, ShardCacheError) else _unreadable(url, exc)
        if on_done is not None:
            on_done(url)

    _run_all(urls, one, threads)
    for url, exc in failed.items():  # the handler runs in the caller's thread, in order
        if handler is None or not handler(exc):
            raise exc
        logger.warning("%s is left out of the epoch: %s", url, exc)
        found[url] = ShardSamples((), 0)
    return {url: found[url] for url in urls}


def _unreadable(url: str, exc: OSError) -> SampleIndexError:
    return SampleIndexError(f"cannot index {url}: {type(exc).__name__}: {exc}", url=url)


def cached_samples(cache: ShardCache, url: str) -> ShardSamples:
    """``url``'s samples: fetched into ``cache`` if needed, scanned once per cached copy."""
    layout = cache.layout
    # Reading the layout is no delivery to the loader: a cached copy counts as no hit (one
    # check, so a copy another process publishes meanwhile is not counted either).
    path = cache.fetch(url, count_hit=False)
    try:
        st = os.stat(path)
    except FileNotFoundError:  # evicted since: fetch it again
        path = cache.fetch(url)
        st = os.stat(path)
    record_path = layout.samples_record_path(path)
    try:
        record = json.loads(layout.fs.read_small(record_path, _RECORD_LIMIT))
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict) and (record.get("ino"), record.get("size")) == (
        st.st_ino,
        st.st_size,
    ):
        return ShardSamples.from_json(record, str(record_path))
    etag = read_meta(layout, path).get("etag")
    found = scan(path, url, etag)
    try:
        write_record(layout, record_path, {**found.as_json(url), "ino": st.st_ino})
    except OSError as exc:  # only a later scan is lost
        logger.warning("cannot keep the sample record of %s at %s: %s", url, record_path, exc)
    return found


def _run_all(urls: Iterable[str], work: Callable[[str], None], threads: int) -> None:
    """``work(url)`` for every URL on a pool; the first failure cancels the rest and is
    raised (a shardcache error as it is, an ``OSError`` as a :class:`SampleIndexError`
    with its URL)."""
    with cf.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = {pool.submit(work, url): url for url in urls}
        try:
            for future in cf.as_completed(futures):
                exc = future.exception()
                if exc is None:
                    continue
                if isinstance(exc, ShardCacheError) or not isinstance(exc, OSError):
                    raise exc
                raise _unreadable(futures[future], exc) from exc
        finally:
            for future in futures:
                future.cancel()


# -- checking a shard against its record ---------------------------------------------


def check_sample(url: str, starts: Sequence[int], index: int, sample: Sample) -> None:
    """A sample read must be where the sample index puts it, and so must the next one (or
    the archive's end after the last)."""
    if index >= len(starts) or starts[index] != sample.offset:
        where = starts[index] if index < len(starts) else "nothing (the index ends)"
        raise stale(url, f"sample {index} at byte {where}", f"one at byte {sample.offset}")
    following = starts[index + 1] if index + 1 < len(starts) else -1
    if sample.end != following:
        seen = "the archive's end" if sample.end < 0 else f"a sample at byte {sample.end}"
        wanted = "the archive's end" if following < 0 else f"a sample at byte {following}"
        raise stale(url, f"{wanted} after sample {index}", seen)


def stale(url: str, expected: object, seen: object) -> SampleIndexError:
    return SampleIndexError(
        f"{url} does not match its sample index: expected {expected}, found {seen}. The "
        "shard changed since it was indexed: make the index again (shardcache index), or "
        "leave index= unset to learn it (an index a job learned is kept in the cache "
        "root's .indexes/ and, with keep_index='data', beside the shards: delete it)",
        url=url,
        expected=expected,
        seen=seen,
    )
