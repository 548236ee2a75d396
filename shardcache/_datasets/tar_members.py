"""WebDataset samples out of a tar stream, each with the byte offset it starts at.

A resumable reader needs what webdataset's tar expansion does not give: where each sample
starts, so that a restart seeks straight to it instead of reading (or decoding) what came
before. The headers are parsed here (ustar, GNU long names, pax ``path``/``size``); the
grouping into samples follows webdataset's (:func:`sample_key`, lower-cased suffixes,
``__meta__`` members skipped, a repeated suffix is an error).

A sample's offset is the offset of the first header block of its first member, extension
headers included, so reading from it yields that sample first. Every header's checksum is
verified: an offset that is not a header (a shard changed since a state was taken) is
refused rather than misread.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from .._base.errors import ShardFormatError

BLOCK = 512
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META_RE = re.compile(r"__[^/]*__($|/)")
_REGULAR = (b"0", b"\0", b"7")  # regular file, old-style regular, contiguous
_GNU_LONGNAME = b"L"
_PAX = (b"x", b"X")
_MAX_MEMBER = 1 << 40  # larger sizes come from damaged headers (base-256 fields reach 2**95)
ADVICE = (
    "Check the source object (tar tvf on a copy of it), then re-create or re-upload it, or "
    "drop it from the shard list; a dataset's handler=wds.warn_and_continue skips such shards"
)
_COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
}


@dataclass(frozen=True)
class Member:
    """A regular file of the archive: its name, bytes and the offset its headers start at."""

    offset: int
    name: str
    data: bytes


@dataclass
class Sample:
    """Consecutive members with one key, and where they start; ``end`` is where the next
    sample (key ``next_key``) starts, -1 if the archive ends after this one."""

    offset: int
    key: str
    files: dict[str, bytes]
    end: int = 0
    next_key: str | None = None

    def as_dict(
        self, url: str, local_path: str | None, source: str | None = None
    ) -> dict[str, Any]:
        """The webdataset sample; ``source``: a mixture source's name (``"__source__"``).
        Built as one literal, the cheapest way a sample (no ``update`` call)."""
        if local_path is None:
            sample: dict[str, Any] = {"__key__": self.key, "__url__": url, **self.files}
        else:
            sample = {
                "__key__": self.key,
                "__url__": url,
                "__local_path__": local_path,
                **self.files,
            }
        if source is not None:
            sample["__source__"] = source
        return sample


def sample_key(name: str) -> tuple[str, str] | None:
    """``"dir/abc.seg.jpg"`` -> ``("dir/abc", "seg.jpg")``, webdataset's split; None for a
    name with no suffix (such members are skipped)."""
    match = _KEY_RE.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2)


def _octal(field: bytes, where: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * (len(field) - 1))) if field[0] & 0x40 else value
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ShardFormatError(
            f"{where}: a tar header field holds {field!r}, not an octal number",
            where=where,
        ) from None


def _checked(header: bytes, where: str) -> None:
    try:
        stored: int | str = _octal(header[148:156], where)
    except ShardFormatError:
        stored = repr(header[148:156])
    computed = sum(header[:148]) + 8 * 32 + sum(header[156:])
    if stored != computed:
        raise ShardFormatError(
            f"{where}: not a tar header (checksum {stored}, computed {computed}); expected a "
            "tar member to start here. The shard is damaged, or a resume state points into a "
            f"shard that changed since the state was taken. {ADVICE}.",
            where=where,
        )


def member_size(header: bytes, where: str) -> int:
    """The size a (checksummed) tar header gives its member."""
    return _octal(header[124:136], where)


def _name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\0":  # POSIX ustar: a prefix directory in 345..500
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def pax_records(data: bytes, where: str) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(data[pos:space])
        except ValueError:
            raise ShardFormatError(
                f"{where}: a pax header record starts with {data[pos:space][:20]!r}, not its "
                "length; the shard is damaged",
                where=where,
            ) from None
        if length <= 0:
            break
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def pax_size(text: str, where: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ShardFormatError(
            f"{where}: a pax header gives the size {text[:20]!r}, not a number", where=where
        ) from None


def _read_exactly(stream: BinaryIO, count: int, where: str) -> bytes:
    data = stream.read(count)
    if len(data) != count:
        raise ShardFormatError(
            f"{where}: the shard ends inside a tar member (expected {count} more bytes, got "
            f"{len(data)}): it is truncated. {ADVICE}.",
            where=where,
        )
    return data


def is_header(block: bytes) -> bool:
    """Whether ``block`` is a whole, checksummed tar header (not an end-of-archive block):
    what an uncompressed tar starts with."""
    if len(block) != BLOCK or block.count(0) == BLOCK:
        return False
    try:
        _checked(block, "")
    except ShardFormatError:
        return False
    return True


def compression(head: bytes) -> str | None:
    """The compression ``head`` (a file's first bytes) starts with, if any."""
    return next((name for magic, name in _COMPRESSED.items() if head.startswith(magic)), None)


def refuse_start(head: bytes, where: str) -> None:
    """Raise what is wrong with a shard whose first block ``head`` is not a tar header,
    unless it is the end-of-archive block of an empty tar."""
    if len(head) == BLOCK and head.count(0) == BLOCK:
        return
    if not head:
        seen = "the shard is empty (0 bytes)"
    elif (kind := compression(head)) is not None:
        seen = (
            f"the shard is {kind}-compressed, which this reader does not decompress (it "
            "reads a tar, or a tar compressed once with gzip, bzip2, xz or lzma)"
        )
    elif len(head) < BLOCK:
        seen = f"the shard is {len(head)} bytes long, starting {head[:16]!r}"
    else:
        seen = f"the shard starts {head[:16]!r}, not a tar header"
    raise ShardFormatError(
        f"{where}: {seen}; expected a tar file (a {BLOCK}-byte header first). {ADVICE}.",
        where=where,
    )


def _skip(stream: BinaryIO, count: int) -> None:
    """Read past ``count`` bytes (a stream that cannot seek, standard input, is read too)."""
    while count > 0:
        got = len(stream.read(min(count, 1 << 20)))
        if not got:
            return  # the end of the stream: a missing padding is not an error
        count -= got


def members(
    stream: BinaryIO,
    offset: int,
    where: str,
    *,
    rename: Callable[[str], str] | None = None,
    select: Callable[[str], bool] | None = None,
) -> Iterator[Member]:
    """The regular, non-``__meta__`` members from ``offset`` (``stream`` is positioned
    there) to the end of the archive; their data is read, everything else is skipped by
    its header. ``rename`` and ``select`` act as webdataset's ``rename_files`` and
    ``select_files``: a member's name is renamed, then a member not selected is skipped."""
    position = offset
    start = offset  # first header block of the member being assembled
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header = stream.read(BLOCK)
        if position == 0 and not is_header(header):
            refuse_start(header, where)  # not a tar at all (an empty tar is zero blocks)
        if len(header) == 0 or header.count(0) == BLOCK:
            return  # the end-of-archive blocks (or a tar without them)
        here = f"{where} at byte {position}"
        if len(header) < BLOCK:
            raise ShardFormatError(
                f"{here}: the shard ends inside a tar header (expected {BLOCK} bytes, got "
                f"{len(header)}): it is truncated. {ADVICE}.",
                where=here,
            )
        _checked(header, here)
        kind = header[156:157]
        size = pax_size(pax["size"], here) if "size" in pax else member_size(header, here)
        if not 0 <= size <= _MAX_MEMBER:
            raise ShardFormatError(
                f"{here}: a tar member of size {size}; expected 0 to {_MAX_MEMBER} bytes. The "
                "shard is damaged",
                where=here,
            )
        padded = -(-size // BLOCK) * BLOCK
        position += BLOCK
        if kind == _GNU_LONGNAME or kind in _PAX:
            data = _read_exactly(stream, padded, here)[:size]
            if kind == _GNU_LONGNAME:
                long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            else:
                pax = pax_records(data, here)
            position += padded
            continue  # an extension header: the member follows
        name = pax.get("path") or long_name or _name(header)
        wanted = kind in _REGULAR and not _META_RE.match(name)
        if wanted and rename is not None:
            name = rename(name)
        if wanted and select is not None:
            wanted = select(name)
        if wanted:
            data = _read_exactly(stream, size, here)
            _skip(stream, padded - size)
            yield Member(start, name, data)
        else:
            _skip(stream, padded)
        position += padded
        start = position
        long_name = None
        pax = {}


def samples(
    stream: BinaryIO,
    offset: int,
    where: str,
    *,
    only_one: bool = False,
    rename: Callable[[str], str] | None = None,
    select: Callable[[str], bool] | None = None,
    deliver_before_damage: bool = False,
) -> Iterator[Sample]:
    """Samples from ``offset`` to the end of the archive (or just the first one), grouped
    as webdataset groups them. ``stream`` must be positioned at ``offset``; ``rename`` and
    ``select`` as in :func:`members`. With ``deliver_before_damage``, the sample being
    assembled when a damaged header or a truncated member is met is yielded before the
    :class:`ShardFormatError` is raised (webdataset delivers it: :mod:`tarfile` ends the
    archive there)."""
    current: Sample | None = None
    found = members(stream, offset, where, rename=rename, select=select)
    while True:
        try:
            member = next(found, None)
        except ShardFormatError:
            if deliver_before_damage and current is not None:
                current.end = -1
                yield current
            raise
        if member is None:
            break
        split = sample_key(member.name)
        if split is None:
            continue
        key, suffix = split
        suffix = suffix.lower()
        if current is None or key != current.key:
            if current is not None:
                current.end, current.next_key = member.offset, key
                yield current
                if only_one:
                    return
            current = Sample(member.offset, key, {})
        if suffix in current.files:
            raise ShardFormatError(
                f"{where}: {member.name!r} repeats the suffix {suffix!r} within sample "
                f"{key!r} (at byte {member.offset}); webdataset refuses such shards too",
                where=where,
            )
        current.files[suffix] = member.data
    if current is not None:
        current.end = -1  # the archive ended: nothing follows
        yield current
