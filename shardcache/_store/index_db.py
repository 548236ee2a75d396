"""The sqlite file of a scope's index: its schema, opening it, and telling a damaged file
from a busy or unreachable one.

The schema: ``entries`` (a published shard: size, inode, "last used" as recorded),
``parts`` (a download in progress and the name it becomes) and ``state``, whose
``total_bytes`` and ``entries`` the triggers keep on every insert, delete and size change:
never summed. The file is made by the cache (its mode and group, never through a link) and
opened with ``journal_mode=WAL`` and ``synchronous=OFF`` (a process crash loses nothing; an
OS crash may lose the last transactions, which is why :mod:`shardcache._store.index` does not trust
a file written before this boot).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import stat

from .._base.errors import CacheDirError
from .._base.process_identity import boot_id as _read_boot_id
from .._disk.layout import CacheLayout

SCHEMA_VERSION = 1
# Seconds sqlite waits for a lock held by another connection. Writers are serialised by the
# eviction lock, so a wait means something unusual (WAL recovery after a crash, the .locks
# directory removed and made again by a tmp cleaner so that two evict.lock files exist):
# short, then this process lists the directory instead (ShardCache._index_call).
BUSY_TIMEOUT = 2.0
_SCHEMA = """
CREATE TABLE entries (
    name TEXT PRIMARY KEY,      -- <hh>/<file name> under data/
    size INTEGER NOT NULL,
    last_used INTEGER NOT NULL, -- mtime in ns as recorded (<= the file's: see _index)
    ino INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX entries_lru ON entries (last_used, name);
CREATE TABLE parts (
    name TEXT PRIMARY KEY,      -- <hh>/<temp name> under data/
    final TEXT NOT NULL         -- <hh>/<published name> it becomes
) WITHOUT ROWID;
CREATE TABLE state (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
INSERT INTO state VALUES ('total_bytes', 0), ('entries', 0), ('ops', 0),
    ('boot_id', ''), ('reconciled_at', 0);
CREATE TRIGGER entries_ins AFTER INSERT ON entries BEGIN
    UPDATE state SET value = value + new.size WHERE key = 'total_bytes';
    UPDATE state SET value = value + 1 WHERE key = 'entries';
END;
CREATE TRIGGER entries_del AFTER DELETE ON entries BEGIN
    UPDATE state SET value = value - old.size WHERE key = 'total_bytes';
    UPDATE state SET value = value - 1 WHERE key = 'entries';
END;
CREATE TRIGGER entries_upd AFTER UPDATE OF size ON entries BEGIN
    UPDATE state SET value = value + new.size - old.size WHERE key = 'total_bytes';
END;
"""


def open_index(
    layout: CacheLayout, st: os.stat_result | None
) -> tuple[sqlite3.Connection, os.stat_result, bool]:
    """A connection to the index file of ``layout`` (``st``: its lstat, None: not there
    yet, then made), its lstat and whether its schema was just created. Raises
    ``sqlite3.DatabaseError`` for a file of another schema version, and ``CacheDirError``
    for one this cache does not trust."""
    path = layout.index_path
    fs, trust = layout.fs, layout.trust
    if st is None:
        layout.make_dir(path.parent)
        # Made by us, with the cache's mode and group (sqlite would use 0644), and never
        # through a link; sqlite gives its -wal and -shm files the same mode.
        with contextlib.suppress(FileExistsError):
            fd = fs.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, trust.file_mode)
            try:
                trust.adopt_file(fd, trust.file_mode)
            finally:
                os.close(fd)
        st = fs.lstat(path)
    if not stat.S_ISREG(st.st_mode) or not trust.trusts_file(st):
        raise CacheDirError(
            f"the cache index {path} is not a regular file this cache trusts; "
            "remove it (it is rebuilt from the cache directory).",
            path=str(path),
        )
    conn = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
    )
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:  # new (we hold the eviction lock: nobody else is making it)
            conn.executescript(
                f"BEGIN IMMEDIATE;{_SCHEMA}PRAGMA user_version={SCHEMA_VERSION};COMMIT;"
            )
            fresh = True
        elif version != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {version}, expected {SCHEMA_VERSION}")
        else:
            fresh = False
    except BaseException:
        conn.close()
        raise
    return conn, st, fresh


def damaged(exc: sqlite3.DatabaseError) -> bool:
    """The file is not (or no longer) a usable database of ours: replace and rebuild it.
    Anything else (a lock held beyond BUSY_TIMEOUT, a disk I/O error such as the directory
    removed under us) is raised: the caller lists the directory instead."""
    if not isinstance(exc, sqlite3.OperationalError):
        return True  # "file is not a database", "malformed", another schema version
    return "malformed" in str(exc) or "not a database" in str(exc)


@functools.cache
def boot_id() -> str:
    """This boot's id, read once per process (stamped on the index at each rebuild)."""
    return _read_boot_id()


def upsert(conn: sqlite3.Connection, name: str, st: os.stat_result) -> None:
    """Record the shard ``name`` as ``st`` says (inserted, or its row replaced)."""
    conn.execute(
        "INSERT INTO entries VALUES (?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
        "size = excluded.size, last_used = excluded.last_used, ino = excluded.ino",
        (name, st.st_size, st.st_mtime_ns, st.st_ino),
    )


__all__ = ["BUSY_TIMEOUT", "SCHEMA_VERSION", "boot_id", "damaged", "open_index", "upsert"]
