"""A miss filled from a peer of the cache mesh, under the shard's lock, before the store.

Each holder the :class:`~shardcache._mesh.holders.PeerSource` names is asked in turn,
unless this process has put it aside after a failure (:mod:`shardcache._mesh.peers`). Its
copy lands exactly as a download does: a private temp file (room made and reserved), the
bytes checked as they arrive against the CRC32C its holder recorded as they landed there
(or, in an older record, its store's checksum) and the size, ETag and version the job
expects (:func:`~shardcache._mesh.verify.fetch_verified`), then the metadata record and
the durable rename; a copy of a shard outside the cache's own share (``visiting``) is
stamped least recently used first (:data:`VISITOR_MTIME`), so eviction takes it before any
shard the cache reads itself. A failure of any kind on the peer's side (no answer, too slow,
refused, a damaged copy) puts that peer aside, is counted, and the next holder or the
store is asked: nothing of a failed peer's copy is ever published. A peer that holds no
copy (404) or is busy (503) is asked again for the next shard.
"""

from __future__ import annotations

import os

from .._base.errors import IntegrityError, PeerFetchError
from .._base.redact import get_logger
from .._disk.layout import ShardId
from .._mesh.client import Answer
from .._mesh.holders import Holding, PeerSource
from .._mesh.peers import health
from .._mesh.verify import Expected, fetch_verified, recorded_checksum, verified_by
from .._store.publish import DiskFull, Publisher
from .._transfer.checksums import etag_checksum
from .._transfer.multipart import PartLayout
from .._transfer.remote import ObjectInfo, Progress
from .stats import StatsCounter

logger = get_logger("shardcache._cache")  # the cache's records keep one logger name

FROM_PEER = "from peer"  # the lock's and the progress's phase while a peer's copy arrives
# A sound peer's answers that give no copy: it holds none (evicted since the hand-out), or
# it is busy (its concurrency cap). The next holder or the store is asked, and the peer is
# not put aside: its other shards are still worth asking it for.
NOT_HERE = frozenset({404, 503})
VISITOR_MTIME = 1.0  # a visiting copy's "last used": before every shard the cache used


class PeerFill:
    """Fills misses from the peers ``source`` names, publishing through ``publisher``."""

    def __init__(self, source: PeerSource, publisher: Publisher, stats: StatsCounter) -> None:
        self._source = source
        self._publisher = publisher
        self._stats = stats

    def fill(self, shard: ShardId, report: Progress) -> ObjectInfo | None:
        """Publish ``shard`` from the first holder whose copy arrives whole and checked; its
        info, or None when no holder gave it (then the store is asked)."""
        expected = self._source.expected(shard)
        if expected is None or expected.size is None:
            return None  # a copy could be of another version: only the store can say
        peers = health()
        for holding in self._source.holders(shard):
            name = str(holding.peer)
            if not peers.usable(name):
                continue
            try:
                info = self._fill_from(holding, shard, expected, report)
            except (PeerFetchError, IntegrityError) as exc:
                corrupt = int(isinstance(exc, IntegrityError))
                self._stats.count(shard.url, peer_fallbacks=1, peer_corruptions=corrupt)
                if isinstance(exc, PeerFetchError) and exc.status in NOT_HERE:
                    logger.debug("peer %s: %s", name, exc.message)  # a sound peer
                else:
                    peers.failed(name, exc.message)
                continue
            except DiskFull:
                return None  # the store's download makes room and retries, once
            peers.succeeded(name)
            return info
        return None

    def _fill_from(
        self, holding: Holding, shard: ShardId, expected: Expected, report: Progress
    ) -> ObjectInfo:
        size = expected.size
        assert size is not None
        wanted = ObjectInfo(shard.url, size, etag=expected.etag, version_id=expected.version_id)
        with self._publisher.begin(shard, wanted) as part, part.file() as out:
            received = 0

            def sink(piece: memoryview) -> None:
                nonlocal received
                out.write(piece)
                received += len(piece)
                part.progressed(received)
                report(phase=FROM_PEER, bytes_done=received, bytes_total=size)

            answer = fetch_verified(
                holding.peer,
                self._source.key,
                holding.request(shard),
                sink,
                expected=expected,
                bounds=self._source.bounds,
            )
            out.flush()
            if self._source.visiting is not None and self._source.visiting(shard):
                os.utime(part.fd, (VISITOR_MTIME, VISITOR_MTIME))  # before the index records it
            info = _info(shard.url, answer)
            part.written(info)
            report(phase="publishing", bytes_done=size, bytes_total=size)
            part.commit(info)
        logger.debug("%s filled from peer %s of the cache mesh", shard.url, holding.peer)
        return info


def _info(url: str, answer: Answer) -> ObjectInfo:
    """The info of a peer's checked copy, from its holder's record: the receiver's record
    then names the same checksums, so it can serve the copy on in turn."""
    record = answer.record
    verified = verified_by(record)
    etag = record.get("etag")
    md5 = etag_checksum(etag)
    return ObjectInfo(
        url,
        answer.size,
        etag=etag,
        version_id=record.get("version_id"),
        md5_checksum=md5 if verified is not None and verified == md5 else None,
        checksum=recorded_checksum(record),
        verified=verified,
        parts_layout=PartLayout.from_record(record.get("parts")),
        mesh_crc32c=record.get("mesh_crc32c"),  # what the bytes were checked against
    )
