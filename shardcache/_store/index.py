"""The scope's index of published shards and downloads in progress (sqlite), so that the
bookkeeping of a miss, a hit and an eviction costs the same with 1,000 or 100,000 shards.

Without it, every miss of a size-bounded cache listed the whole data directory to count
its bytes and find the least recently used shard: linear in the cache, quadratic to warm.

What it holds (``<scope>/.locks/index.sqlite``, :attr:`CacheLayout.index_path`):

* ``entries``: every published shard (``<hh>/<name>``) with its size, inode and "last used"
  (mtime in ns) as recorded; ``state.total_bytes`` is kept by triggers, never summed;
* ``parts``: every download in progress that reserved space (``<hh>/.<name>...part``) and
  the published name it will become. Their bytes are counted by ``lstat``-ing each one when
  room is made (they are as many as downloads in flight), so a growing ``pipe:`` download
  and one a cleaner removed count exactly as they did when the directory was listed; the
  part of a dead process of this host (killed, preempted) is removed then, and counts
  until it is (:mod:`shardcache._store.leftovers`).

Who writes it, and when. Only processes with ``SHARDCACHE_MAX_BYTES`` on a local disk, and
only under the scope's eviction lock (``.locks/evict.lock``), which already serialises
reservations, publishes and evictions: sqlite's own locks therefore never have two writers
to arbitrate (``status``, ``verify`` and ``clean`` do not read it: they report what the
directory holds, listing it once). A part is registered
*before* its file is created, a publish is recorded right after its rename, an evicted
shard's row is deleted in the eviction's transaction.

Hits never write it. A hit refreshes the file's mtime at most once a minute as before
(:func:`shardcache._store.eviction.touch`); the evictor walks the index from the oldest recorded
"last used", ``lstat``s each candidate, and when the file's mtime is newer than the record
it records the newer time and moves on (the row comes back in its new place). Recorded
times never exceed real ones (except for a file set back by hand), so the first candidate
whose record is true is the least recently used shard: exact LRU, and each touch costs
the evictor at most one ``lstat`` and one row update later.

Crash safety (SIGKILL anywhere). Every transaction is atomic (WAL). A process killed
between its rename and its publish record leaves a ``parts`` row whose file is gone: the
next count looks for the published name and records it. Killed mid-eviction, the
transaction rolls back, leaving rows of shards already unlinked: they are the oldest, so
the evictor meets them first whenever it next needs room, finds them missing and drops
them (the count was too high meanwhile: the cache held less, never more). A file removed
behind the index's back (``shardcache clean``, a tmp cleaner, ``verify``, another user) is
dropped the same way.

Rebuilt from the directory (one listing, the old cost, once) when the file is missing,
is not a database or is damaged, has another schema version, was written before this
boot (``synchronous=OFF`` and ``journal_mode=WAL``: a process crash loses nothing, an OS
crash may lose the last transactions, so they are not trusted across a reboot), when an
eviction cannot make room (the count may be too high), when ``evict`` is asked for
explicitly (the CLI's answer must be exact), and every :data:`RECONCILE_EVERY` operations
or :data:`RECONCILE_AGE` seconds (amortised: one listed entry per operation at most), which
catches shards published by processes that do not keep the index (no ``max_bytes``, an
older version).

Not on network file systems: sqlite's POSIX locks and WAL's shared memory are not reliable
across NFS/Lustre clients (and the scope may be shared by several nodes), so there the
evictor keeps listing the directory (:func:`shardcache._store.eviction.evict_locked`).

The sqlite file itself (schema, triggers, opening, telling damage from a busy lock) is
:mod:`shardcache._store.index_db`'s.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .._base.errors import CacheDirError
from .._base.redact import get_logger
from .._disk.layout import CacheLayout, parse_temp_name
from .._disk.metadata import read_meta
from .eviction import CacheEntry, EvictReport, list_dir, log_evicted, remove
from .index_db import boot_id, damaged, open_index, upsert
from .leftovers import remove_if_dead

logger = get_logger(__name__)
_T = TypeVar("_T")

RECONCILE_EVERY = 1000  # ... operations, or as many as the index has entries if more
RECONCILE_AGE = 3600.0  # seconds: a reconcile at least this often while the index is used
_BATCH = 64  # eviction candidates read per query


@dataclass
class IndexCounters:
    """What this process's index did (for tests and benchmarks: counted, not timed)."""

    rebuilds: int = 0
    reconciles: int = 0
    corrections: int = 0  # rows fixed from the file system (newer mtime, gone, replaced)
    dead_parts: int = 0  # downloads of dead processes removed when counting
    reopened: int = 0


def _serialised(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` holding the index's own lock (see :class:`Index`)."""

    @functools.wraps(method)
    def locked(self: Index, *args: Any, **kwargs: Any) -> _T:
        with self._thread_lock():
            return method(self, *args, **kwargs)

    return locked


class Index:
    """The index of one scope directory. Every method must be called under the scope's
    eviction lock (:func:`shardcache._store.eviction.evict_lock`), and runs under a lock of its
    own as well: two threads of a process can both hold the eviction lock when its
    directory was removed and made again (each then flocks a different file), and one of
    them closing the connection while the other uses it would crash sqlite.

    Reconciled with the directory every ``reconcile_every`` operations (or as many as it
    has entries, if more), and every :data:`RECONCILE_AGE` seconds."""

    def __init__(self, layout: CacheLayout, *, reconcile_every: int = RECONCILE_EVERY) -> None:
        self.layout = layout
        self.reconcile_every = reconcile_every
        self.path = layout.index_path
        self.counters = IndexCounters()
        self._conn: sqlite3.Connection | None = None
        self._identity: tuple[int, int, int] | None = None  # (pid, st_dev, st_ino)
        self._suspect = False  # an operation failed: rebuild before trusting it again
        self._lock = (os.getpid(), threading.RLock())

    def _thread_lock(self) -> threading.RLock:
        """This process's lock (a forked child makes its own: the parent's may be held)."""
        pid, lock = self._lock
        if pid != os.getpid():
            self._lock = (os.getpid(), threading.RLock())
            lock = self._lock[1]
        return lock

    @_serialised
    def invalidate(self) -> None:
        """An operation on the index failed (its directory removed under us, a lock held
        too long): the next use reopens it and rebuilds it from the directory first."""
        self.close()
        self._suspect = True

    # -- operations --------------------------------------------------------------------

    @_serialised
    def add_part(self, part: Path, final: Path) -> None:
        """Register a download before its file ``part`` is created (so no part is ever
        uncounted); its bytes are whatever the file holds when room is next made."""
        self._write(
            "INSERT OR REPLACE INTO parts VALUES (?, ?)", (self._rel(part), self._rel(final))
        )

    @_serialised
    def published(self, part: Path, final: Path) -> None:
        """Record that ``part`` was renamed to ``final`` (right after the rename)."""
        st = _lstat(self.layout, final)

        def work(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM parts WHERE name = ?", (self._rel(part),))
            if st is not None:
                upsert(conn, self._rel(final), st)
            self._count_op(conn)

        self._run(work)

    @_serialised
    def forget(self, path: Path) -> None:
        """A published shard was removed (``ShardCache.remove``)."""
        self._write("DELETE FROM entries WHERE name = ?", (self._rel(path),))

    @_serialised
    def used_bytes(self) -> int:
        """Published bytes plus the bytes of downloads in progress, as counted now."""
        return self._run(self._used)

    @_serialised
    def evict(self, max_bytes: int, reserve: int = 0) -> EvictReport:
        """Remove least-recently-used shards until published + in-progress + ``reserve``
        bytes fit in ``max_bytes`` (or nothing evictable is left); when they still do not
        fit, rebuild from the directory once (the count may be too high) and go on."""
        report = EvictReport()
        self._run(lambda conn: self._evict_pass(conn, max_bytes, reserve, report))
        if report.kept_bytes + reserve > max_bytes:
            logger.info(
                "no room in %s by the index (%d + %d > %d bytes): rebuilding it from the directory",
                self.layout.scope_dir,
                report.kept_bytes,
                reserve,
                max_bytes,
            )
            self.rebuild()
            # Shards skipped as in use are met (and counted) again.
            report = EvictReport(removed=report.removed, freed_bytes=report.freed_bytes)
            self._run(lambda conn: self._evict_pass(conn, max_bytes, reserve, report))
        log_evicted(self.layout, report, max_bytes)
        return report

    @_serialised
    def rebuild(self) -> None:
        """Make the index say exactly what the data directory holds (one listing)."""
        entries, parts = _list_data(self.layout)

        def work(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM entries")
            conn.execute("DELETE FROM parts")
            # Counted afresh (the triggers only add and subtract): a drifted total goes too.
            conn.execute("UPDATE state SET value = 0 WHERE key IN ('total_bytes', 'entries')")
            conn.executemany("INSERT INTO entries VALUES (?, ?, ?, ?)", entries)
            conn.executemany("INSERT INTO parts VALUES (?, ?)", parts)
            conn.executemany(
                "UPDATE state SET value = ? WHERE key = ?",
                [(0, "ops"), (boot_id(), "boot_id"), (time.time(), "reconciled_at")],
            )

        self._run(work, check=False)
        self.counters.rebuilds += 1

    @_serialised
    def close(self) -> None:
        if self._conn is not None and self._identity and self._identity[0] == os.getpid():
            self._conn.close()
        self._conn, self._identity = None, None

    # -- eviction ----------------------------------------------------------------------

    def _evict_pass(
        self, conn: sqlite3.Connection, max_bytes: int, reserve: int, report: EvictReport
    ) -> None:
        used = self._used(conn)
        after: tuple[int, str] = (-(1 << 62), "")
        while used + reserve > max_bytes:
            rows = conn.execute(
                "SELECT name, size, last_used, ino FROM entries WHERE (last_used, name) > "
                "(?, ?) ORDER BY last_used, name LIMIT ?",
                (*after, _BATCH),
            ).fetchall()
            if not rows:
                break
            for name, size, last_used, ino in rows:
                after = (last_used, name)
                if used + reserve <= max_bytes:
                    break
                used += self._evict_candidate(conn, name, size, last_used, ino, report)
        report.kept_bytes = used
        self._count_op(conn)

    def _evict_candidate(  # noqa: PLR0917
        self,
        conn: sqlite3.Connection,
        name: str,
        size: int,
        last_used: int,
        ino: int,
        report: EvictReport,
    ) -> int:
        """Evict the candidate ``name`` if its record is true; the change in used bytes."""
        path = self.layout.data_dir / name
        st = _lstat(self.layout, path)
        if st is None:  # removed behind the index's back (or by a killed evictor)
            conn.execute("DELETE FROM entries WHERE name = ?", (name,))
            self.counters.corrections += 1
            return -size
        if st.st_mtime_ns > last_used or st.st_ino != ino or st.st_size != size:
            # Used since recorded (a hit's touch), or replaced: record what is there; a
            # newer row comes back later in the walk, at its place in the order.
            upsert(conn, name, st)
            self.counters.corrections += 1
            if st.st_mtime_ns > last_used:
                return st.st_size - size
            size = st.st_size
        meta = read_meta(self.layout, path)  # for the report: which URL went
        if remove(self.layout, path):
            conn.execute("DELETE FROM entries WHERE name = ?", (name,))
            report.removed.append(
                CacheEntry(
                    path=path,
                    size=size,
                    last_used=st.st_mtime,
                    url=meta.get("url"),
                    etag=meta.get("etag"),
                )
            )
            report.freed_bytes += size
            return -size
        report.in_use += 1
        report.in_use_bytes += size
        return 0

    def _count_parts(self, conn: sqlite3.Connection) -> int:
        """Bytes of the registered downloads, each ``lstat``-ed now. A part of a dead
        writer (:mod:`shardcache._store.leftovers`) is removed. A part whose file is gone was
        published (its shard recorded now if a killed process could not), failed, or was
        cleaned up: its row goes."""
        total = 0
        for name, final in conn.execute("SELECT name, final FROM parts").fetchall():
            path = self.layout.data_dir / name
            st = _lstat(self.layout, path)
            if st is not None and not remove_if_dead(self.layout, path, st):
                total += st.st_size
                continue
            self.counters.dead_parts += st is not None
            conn.execute("DELETE FROM parts WHERE name = ?", (name,))
            published = _lstat(self.layout, self.layout.data_dir / final)
            if published is not None:
                known = conn.execute("SELECT ino FROM entries WHERE name = ?", (final,)).fetchone()
                if known is None or known[0] != published.st_ino:
                    upsert(conn, final, published)
                    self.counters.corrections += 1
        return total

    # -- connection, transactions, repair --------------------------------------------

    def _used(self, conn: sqlite3.Connection) -> int:
        parts = self._count_parts(conn)  # first: it may record a published shard
        return self._total(conn) + parts

    @staticmethod
    def _total(conn: sqlite3.Connection) -> int:
        return int(conn.execute("SELECT value FROM state WHERE key = 'total_bytes'").fetchone()[0])

    def _count_op(self, conn: sqlite3.Connection) -> None:
        conn.execute("UPDATE state SET value = value + 1 WHERE key = 'ops'")

    def _write(self, sql: str, args: tuple[object, ...]) -> None:
        self._run(lambda conn: conn.execute(sql, args))

    def _rel(self, path: Path) -> str:
        return f"{path.parent.name}/{path.name}"

    def _run(self, work: Callable[[sqlite3.Connection], _T], *, check: bool = True) -> _T:
        """``work`` in one write transaction on a usable index (opened, repaired or rebuilt
        first). A damaged file found on the way is replaced and rebuilt, and ``work`` runs
        once more on the new one (what it did to the files is then in the rebuild)."""
        for attempt in (1, 2):
            conn = self._connection(check=check)
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    result = work(conn)
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
                return result
            except sqlite3.DatabaseError as exc:
                if attempt == 2 or not damaged(exc):
                    raise self._error(exc) from exc
                logger.warning("the cache index %s is damaged (%s): rebuilding it", self.path, exc)
                self._replace()
        raise AssertionError("unreachable")

    def _connection(self, *, check: bool) -> sqlite3.Connection:
        """The open connection, reopened if this is a forked child or the file was replaced
        (another process rebuilt it), and rebuilt when stale (see the module docstring)."""
        try:
            st = self.layout.fs.lstat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise self._error(exc) from exc
        ident = None if st is None else (os.getpid(), st.st_dev, st.st_ino)
        if self._conn is not None and ident == self._identity:
            conn = self._conn
            if check and (self._suspect or self._stale(conn)):
                self._suspect = False
                self._reconcile()
            return conn
        if self._conn is not None:
            self.counters.reopened += 1
        self.close()
        try:
            self._open(st)
        except sqlite3.DatabaseError as exc:
            if not damaged(exc):
                raise self._error(exc) from exc
            logger.warning("the cache index %s is unusable (%s): rebuilding it", self.path, exc)
            self._replace()
        assert self._conn is not None
        return self._conn

    def _open(self, st: os.stat_result | None) -> None:
        conn, st, fresh = open_index(self.layout, st)
        self._conn, self._identity = conn, (os.getpid(), st.st_dev, st.st_ino)
        if fresh or self._suspect or self._stale(conn):
            self._suspect = False
            self._reconcile()

    def _stale(self, conn: sqlite3.Connection) -> bool:
        state = dict(conn.execute("SELECT key, value FROM state").fetchall())
        if state.get("boot_id") != boot_id():
            return True
        if time.time() - float(state.get("reconciled_at") or 0) > RECONCILE_AGE:
            return True
        ops, entries = int(state.get("ops") or 0), int(state.get("entries") or 0)
        return ops > max(self.reconcile_every, entries)

    def _reconcile(self) -> None:
        self.counters.reconciles += 1
        self.rebuild()

    def _replace(self) -> None:
        """Remove a damaged index (and its WAL files) and build a new one."""
        self.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                self.layout.fs.unlink(self.path.with_name(self.path.name + suffix))
        self._connection(check=False)

    def _error(self, exc: BaseException) -> CacheDirError:
        return CacheDirError(
            f"cannot use the cache index {self.path}: {exc}. Check that {self.path.parent} "
            "is writable on a healthy local file system; removing the file is safe (it is "
            "rebuilt from the cache directory).",
            path=str(self.path),
        )


def _lstat(layout: CacheLayout, path: Path) -> os.stat_result | None:
    """``path``'s lstat if it is a regular file; None if it is gone or not a file."""
    try:
        st = layout.fs.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except CacheDirError:
        raise
    return st if stat.S_ISREG(st.st_mode) else None


def _list_data(
    layout: CacheLayout,
) -> tuple[list[tuple[str, int, int, int]], list[tuple[str, str]]]:
    """Rows of every published shard and download in progress under ``data/``."""
    entries: list[tuple[str, int, int, int]] = []
    parts: list[tuple[str, str]] = []
    seen: set[int] = set()  # a file renamed during the listing may show up twice
    for bucket, bucket_st in list_dir(layout.fs, layout.data_dir):
        if not stat.S_ISDIR(bucket_st.st_mode):
            continue
        for name, st in list_dir(layout.fs, layout.data_dir / bucket):
            if not stat.S_ISREG(st.st_mode) or st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            temp = parse_temp_name(name)
            if temp is not None:
                parts.append((f"{bucket}/{name}", f"{bucket}/{temp.final}"))
            else:
                entries.append((f"{bucket}/{name}", st.st_size, st.st_mtime_ns, st.st_ino))
    return entries, parts


__all__ = ["Index", "IndexCounters"]
