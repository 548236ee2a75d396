"""A multipart upload's parts: their layout, learned from the store, and their checksums
combined as the store combines them.

An S3 object uploaded in N parts is described by a checksum of its parts' checksums: its
ETag is ``<MD5 of the parts' MD5 digests joined>-N`` (unless encrypted with KMS or a
customer key), and a ``COMPOSITE`` additional checksum is ``<CRC32 / CRC32C / SHA1 /
SHA256 of the parts' digests joined>-N``. Checking either needs the part boundaries, which
only the store knows: ``HeadObject`` with ``PartNumber=k`` gives part k's size and the
count of parts.

:func:`part_layout` asks for part 1 only. Uploaders (boto3, the AWS CLI, s3fs, rclone)
cut every part but the last to one size, so when ``ceil(size / first) == N`` the layout is
taken as that regular one (:attr:`PartLayout.assumed`); otherwise every part's size is
asked for. A regular layout taken wrongly shows as a mismatch, and only then
:func:`exact_layout` asks for every part and the download is hashed again under it
(:func:`rehash`) before it is called corrupt.

A :class:`PartsHasher` hashes bytes in order, cutting at the part boundaries; a parallel
download aligned to the parts hashes each part in its own thread and joins the digests
with :func:`composite_value`.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from fsspec.asyn import sync

from .._base.url_kinds import s3_version
from .._retry.throttle import Throttle, throttled_call
from .checksums import Hasher

_HEAD_CONCURRENCY = 16  # part HEADs in flight when every part's size is asked for
_REHASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class PartLayout:
    """The sizes of an object's upload parts, in order. ``assumed``: taken as regular from
    the first part's size (every part but the last that size), not asked for part by part."""

    sizes: tuple[int, ...]
    assumed: bool = False

    @classmethod
    def regular(cls, first: int, count: int, total: int) -> PartLayout | None:
        """Every part ``first`` bytes but the last (the rest), if that makes ``count``
        parts of ``total`` bytes; else None."""
        if first <= 0 or count < 1 or math.ceil(total / first) != count:
            return None
        last = total - first * (count - 1)
        return cls((first,) * (count - 1) + (last,), assumed=True)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def spans(self) -> list[tuple[int, int]]:
        """Each part's ``[start, end)`` in the object."""
        spans, start = [], 0
        for size in self.sizes:
            spans.append((start, start + size))
            start += size
        return spans

    def as_record(self) -> list[list[int]]:
        """Run-length ``[[size, repeat], ...]`` (a regular layout is at most two runs)."""
        runs: list[list[int]] = []
        for size in self.sizes:
            if runs and runs[-1][0] == size:
                runs[-1][1] += 1
            else:
                runs.append([size, 1])
        return runs

    @classmethod
    def from_record(cls, runs: Any) -> PartLayout | None:
        """The layout :meth:`as_record` wrote; None for anything else."""
        try:
            sizes = tuple(int(size) for size, repeat in runs for _ in range(int(repeat)))
        except (TypeError, ValueError):
            return None
        return cls(sizes) if sizes and min(sizes) > 0 else None


def composite_value(algorithm: str, digests: Sequence[bytes]) -> str:
    """The checksum of the parts' ``digests`` joined, encoded as the store encodes it
    (hex for MD5, base64 otherwise), without the ``-N``."""
    hasher = Hasher(algorithm)
    hasher.update(b"".join(digests))
    return hasher.value()


class PartsHasher:
    """A multipart upload's checksum of bytes fed in order (any piece sizes)."""

    def __init__(self, algorithm: str, layout: PartLayout) -> None:
        self.algorithm = algorithm
        self._sizes = layout.sizes
        self._digests: list[bytes] = []
        self._part = Hasher(algorithm)
        self._left = self._sizes[0]

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            if self._left == 0:  # bytes beyond the last part: the size check reports them
                return
            take = view[: self._left]
            self._part.update(take)
            self._left -= len(take)
            view = view[len(take) :]
            if self._left == 0:
                self._digests.append(self._part.digest())
                if len(self._digests) < len(self._sizes):
                    self._part = Hasher(self.algorithm)
                    self._left = self._sizes[len(self._digests)]

    @property
    def digests(self) -> list[bytes]:
        """The digest of each part complete so far."""
        return list(self._digests)

    def value(self) -> str:
        """The composite checksum (of the parts complete so far: a short body is caught by
        the size check first)."""
        return composite_value(self.algorithm, self._digests)


def differing_parts(
    algorithm: str, layout: PartLayout, ours: list[bytes], theirs: list[str] | None
) -> tuple[str, list[int]]:
    """The parts whose ``algorithm`` digest (``ours``, raw) is not the store's own
    checksum of the part (``theirs``, base64; None: the store reports none), said for a
    message, and their numbers (from 1)."""
    if theirs is None:
        return "the store reports no checksum of each part, so which one differs is not known", []
    encoded = [base64.b64encode(d).decode() for d in ours]
    numbers = [n for n, (a, b) in enumerate(zip(encoded, theirs, strict=True), 1) if a != b]
    spans = layout.spans()
    said = [
        f"part {n} of {len(ours)} (bytes {spans[n - 1][0]}-{spans[n - 1][1] - 1}) has "
        f"{algorithm.upper()} {encoded[n - 1]}, the store's part has {theirs[n - 1]}"
        for n in numbers
    ]
    return "; ".join(said) or "every part matches the store's checksum of it", numbers


def rehash(out: BinaryIO, algorithm: str, layout: PartLayout) -> PartsHasher:
    """The multipart checksum of the first ``layout.total`` bytes of the file ``out``,
    read back (from the page cache, just written)."""
    hasher = PartsHasher(algorithm, layout)
    out.flush()
    fd = out.fileno()
    buf = memoryview(bytearray(_REHASH_BLOCK))
    done = 0
    while done < layout.total:
        n = os.preadv(fd, [buf[: min(len(buf), layout.total - done)]], done)
        if n <= 0:
            break
        hasher.update(buf[:n])
        done += n
    return hasher


def part_layout(
    fs: Any, path: str, *, version: str | None, total: int, count: int, throttle: Throttle
) -> PartLayout | None:
    """The layout of an object of ``total`` bytes uploaded in ``count`` parts: one
    ``HeadObject`` of part 1, and of every other part only when the sizes are not regular.
    None when the store does not describe the parts (no parts count, or another one)."""
    first = _head_part(fs, path, version, 1, throttle)
    if first.get("PartsCount") != count:
        return None
    size = int(first["ContentLength"])
    return PartLayout.regular(size, count, total) or _every_part(
        fs, path, version=version, total=total, count=count, throttle=throttle, first=size
    )


def exact_layout(
    fs: Any, path: str, *, version: str | None, total: int, count: int, throttle: Throttle
) -> PartLayout | None:
    """Every part's size, asked for part by part (after a regular layout did not check)."""
    return _every_part(
        fs, path, version=version, total=total, count=count, throttle=throttle, first=None
    )


def _every_part(
    fs: Any,
    path: str,
    *,
    version: str | None,
    total: int,
    count: int,
    throttle: Throttle,
    first: int | None,
) -> PartLayout | None:
    numbers = range(1 if first is None else 2, count + 1)
    heads = _heads(fs, path, version, numbers, throttle)
    sizes = ([] if first is None else [first]) + [int(h["ContentLength"]) for h in heads]
    return PartLayout(tuple(sizes)) if sum(sizes) == total else None


def part_checksums(
    fs: Any, path: str, *, version: str | None, count: int, algorithm: str, throttle: Throttle
) -> list[str] | None:
    """Each part's own ``algorithm`` checksum, as the store reports it (S3 does, for a
    ``HeadObject`` of a part with ``ChecksumMode``, of an upload made with checksums); None
    when it reports none for some part. Asked only after a checksum did not match, to name
    the part that differs."""
    heads = _heads(fs, path, version, range(1, count + 1), throttle, checksum_mode=True)
    values = [h.get(f"Checksum{algorithm.upper()}") for h in heads]
    return values if all(isinstance(v, str) and v for v in values) else None  # type: ignore[return-value]


def _heads(
    fs: Any,
    path: str,
    version: str | None,
    numbers: range,
    throttle: Throttle,
    *,
    checksum_mode: bool = False,
) -> list[Any]:
    """``HeadObject`` of each part of ``numbers``, ``_HEAD_CONCURRENCY`` at a time."""
    with cf.ThreadPoolExecutor(
        min(_HEAD_CONCURRENCY, max(len(numbers), 1)), thread_name_prefix="shardcache-head"
    ) as pool:
        return list(
            pool.map(
                lambda n: _head_part(fs, path, version, n, throttle, checksum_mode=checksum_mode),
                numbers,
            )
        )


def _head_part(
    fs: Any,
    path: str,
    version: str | None,
    number: int,
    throttle: Throttle,
    *,
    checksum_mode: bool = False,
) -> Any:
    """``HeadObject`` of part ``number`` (of ``version`` when the bucket keeps versions).
    No ``If-Match``: a layout read from a replaced object only makes the checksum differ,
    which restarts the download as any mismatch does (and moto compares it with the part's
    own ETag)."""
    bucket, key, in_path = fs.split_path(path)
    kw: dict[str, Any] = {"PartNumber": number}
    if checksum_mode:
        kw["ChecksumMode"] = "ENABLED"
    if in_path or s3_version(path) or version:
        kw["VersionId"] = in_path or s3_version(path) or version
    return throttled_call(
        throttle,
        "HEAD",
        lambda: sync(fs.loop, fs._call_s3, "head_object", Bucket=bucket, Key=key, **kw),
    )


__all__ = [
    "PartLayout",
    "PartsHasher",
    "composite_value",
    "differing_parts",
    "exact_layout",
    "part_checksums",
    "part_layout",
    "rehash",
]
