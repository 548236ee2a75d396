"""A peer's whole copy checked as it arrives: against the CRC32C its holder recorded as the
bytes landed (``mesh_crc32c``; else, for an older record, the checksum the holder's download
was verified by: a full-object checksum, or a multipart upload's over the recorded parts),
its size, and the identity (size, ETag, version) the receiver expects. Size alone is never
enough: a record without a checksum is refused before any byte is taken.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._base.errors import IntegrityError, PeerFetchError
from .._transfer.checksums import MESH_CRC, Checksum, Hasher, etag_checksum
from .._transfer.multipart import PartLayout, PartsHasher
from .auth import JobKey
from .client import Answer, Bounds, Peer, fetch_range
from .served import ShardRequest


@dataclass(frozen=True)
class Expected:
    """What the receiver knows the shard to be (its dataset lock, or the store's answer):
    None where it knows nothing of that field."""

    size: int | None = None
    etag: str | None = None
    version_id: str | None = None


def recorded_checksum(record: dict[str, Any]) -> Checksum | None:
    """The store's checksum a holder's record names (its ``checksum``), if any."""
    described = record.get("checksum")
    if not isinstance(described, dict) or not described.get("algorithm"):
        return None
    parts = described.get("parts")
    try:
        count = None if parts is None else int(parts)
    except (TypeError, ValueError):
        return None  # not a record this version wrote
    return Checksum(
        str(described["algorithm"]), str(described.get("value")), "the holder's record", count
    )


def verified_by(record: dict[str, Any]) -> Checksum | None:
    """The checksum the holder's download was verified against (``verified`` names its
    method): the store's additional checksum, or the ETag's MD5 where the holder's download
    was checked by it; None for a copy verified by its size only."""
    method = record.get("verified")
    checksum = recorded_checksum(record)
    if checksum is not None and checksum.method == method:
        return checksum
    md5 = etag_checksum(record.get("etag"))
    return md5 if md5 is not None and md5.method == method else None


def checked_by(record: dict[str, Any]) -> Checksum | None:
    """What a peer's copy is checked against: the CRC32C its holder recorded of its bytes
    as they landed (``mesh_crc32c``, after the store's check passed), else the checksum its
    download was verified by (records made before ``mesh_crc32c``); None: nothing but the
    size, refused."""
    crc = record.get("mesh_crc32c")
    if isinstance(crc, str) and crc:
        return Checksum(MESH_CRC, crc, "the holder's CRC32C")
    return verified_by(record)


class PeerCheck:
    """The running check of ``url``'s copy from ``peer``, whose holder's record is
    ``record``; :meth:`finish` raises :class:`IntegrityError` naming the peer."""

    def __init__(self, url: str, peer: Peer, record: dict[str, Any], expected: Expected) -> None:
        self.url, self.peer, self.size = url, peer, record.get("size")
        for field in ("size", "etag", "version_id"):
            want = getattr(expected, field)
            if want is not None and record.get(field) != want:
                raise self._refused(f"holds {field} {record.get(field)!r}, expected {want!r}")
        checksum = checked_by(record)
        if checksum is None:
            raise self._refused("recorded no checksum of its copy; size alone proves nothing")
        self.algorithm, self.value, parts = checksum.algorithm, checksum.value, checksum.parts
        self._hasher: Hasher | PartsHasher
        try:
            if parts is None:
                self._hasher = Hasher(self.algorithm)
            else:
                layout = PartLayout.from_record(record.get("parts"))
                if layout is None or len(layout.sizes) != parts or layout.total != self.size:
                    raise self._refused(
                        f"recorded no layout of the {parts} parts its checksum is over"
                    )
                self._hasher = PartsHasher(self.algorithm, layout)
        except ValueError:  # hashlib knows no such algorithm
            raise self._refused(
                f"recorded a checksum of an unknown kind {self.algorithm!r}"
            ) from None
        self.received = 0

    def _refused(self, what: str) -> PeerFetchError:
        return PeerFetchError(
            f"Peer {self.peer} of the cache mesh {what} for {self.url}; the shard is fetched "
            "from the store instead.",
            url=self.url,
            peer=str(self.peer),
            status=200,
            cause=None,
        )

    def update(self, piece: memoryview) -> None:
        self._hasher.update(piece)
        self.received += len(piece)

    def finish(self) -> None:
        """Raise :class:`IntegrityError` unless the bytes are the recorded size and checksum."""
        seen = self._hasher.value() if self.received == self.size else None
        if seen == self.value:
            return
        what = (
            f"{self.received} bytes arrived, the holder recorded {self.size}"
            if seen is None
            else f"{self.algorithm.upper()} of the bytes is {seen}, the holder recorded "
            f"{self.value}"
        )
        raise IntegrityError(
            f"{self.url} from peer {self.peer} of the cache mesh: {what} from the store. The "
            "peer's copy is damaged (bit rot, or changed in place); its bytes were not "
            "delivered, and the shard is fetched from the store instead. Run `shardcache "
            "verify` on that node.",
            url=self.url,
            peer=str(self.peer),
            expected=self.value,
            seen=seen,
            algorithm=self.algorithm,
        )


def fetch_verified(
    peer: Peer,
    key: JobKey,
    shard: ShardRequest,
    sink: Callable[[memoryview], object],
    *,
    expected: Expected = Expected(),
    bounds: Bounds | None = None,
) -> Answer:
    """Give ``sink`` ``shard``'s whole copy from ``peer``, checked as it arrives; the caller
    publishes what ``sink`` kept only when this returns (it raises
    :class:`PeerFetchError` or :class:`IntegrityError` otherwise)."""
    checks: list[PeerCheck] = []

    def begin(answer: Answer) -> None:
        checks.append(PeerCheck(shard.url, peer, answer.record, expected))

    def checked(piece: memoryview) -> None:
        checks[0].update(piece)
        sink(piece)

    answer = fetch_range(peer, key, shard, checked, bounds=bounds or Bounds(), on_answer=begin)
    checks[0].finish()
    return answer
