"""The owner record of a shard lock: where it lives, what it says, how it is read and judged.

A holder writes a small JSON record (host, boot, pid namespace, pid and start time, rank,
thread, token, redacted URL, phase, bytes) beside its flock (``<hash>.owner``) or as its
lease (``<hash>.lease``). Waiters, ``status`` and ``clean`` read it to say who holds a lock
and whether that process is alive. The bytes on disk are :func:`encode_record`'s alone, so
an unchanged record reads back identical and a waiter can tell "renewed" from "silent".
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from .._base.process_identity import ProcessIdentity
from .._base.redact import redact_url
from .._base.safefs import SafeFS
from .._disk.layout import owner_path

UNREADABLE = b"\0unreadable"  # a record that exists but cannot be read (a link, no access)


def new_record(*, rank: int, token: str, url: str, **extra: Any) -> dict[str, Any]:
    """A fresh owner record naming this process and thread as the holder."""
    me = ProcessIdentity.current()
    return {
        "host": me.host,
        "boot_id": me.boot_id,
        "pidns": me.pidns,
        "pid": me.pid,
        "start_ticks": me.start_ticks,
        "rank": rank,
        "thread": threading.current_thread().name,
        "token": token,
        "url": redact_url(url),  # the record is on disk: no credentials
        "since": time.time(),
        "seq": 0,
        **extra,
    }


def encode_record(record: dict[str, Any]) -> bytes:
    """A record's bytes on disk (sorted keys: the same record, the same bytes)."""
    return json.dumps(record, sort_keys=True).encode()


def rewrite(fd: int, data: bytes) -> None:
    """Replace the whole content of the open record ``fd`` with ``data``."""
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def read_raw(fs: SafeFS, path: Path) -> bytes | None:
    """A record's bytes, never following a symbolic link; None if there is none."""
    try:
        return fs.read_small(path)
    except FileNotFoundError:
        return None
    except OSError:  # a link, a FIFO, no access: judged like garbage (expires, then broken)
        return UNREADABLE


def parse_record(raw: bytes | None) -> dict[str, Any] | None:
    """A record's parsed form; None if empty, not JSON or not an object."""
    if not raw:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_record(fs: SafeFS, path: Path) -> tuple[bytes | None, dict[str, Any] | None]:
    """The raw bytes of an owner/lease/claim record and its parsed form (None if unreadable)."""
    raw = read_raw(fs, Path(path))
    if raw is UNREADABLE:
        return None, None
    return raw, parse_record(raw)


def read_owner(fs: SafeFS, lock_path: Path) -> dict[str, Any] | None:
    """The owner record (``<hash>.owner``) beside the flock file ``lock_path``, if readable."""
    return read_record(fs, owner_path(lock_path))[1]


def holder_verdict(record: dict[str, Any] | None) -> tuple[str, str]:
    """("alive" | "dead" | "unknown", why) for the process a lock record names."""
    if record is None:
        return "unknown", "no readable owner record yet"
    try:
        holder = ProcessIdentity(
            host=str(record["host"]),
            boot_id=str(record.get("boot_id", "")),
            pidns=str(record.get("pidns", "")),
            pid=int(record["pid"]),
            start_ticks=record.get("start_ticks"),
        )
    except (KeyError, TypeError, ValueError):
        return "unknown", "the owner record is malformed"
    return holder.liveness()


def describe_holder(record: dict[str, Any] | None) -> str:
    """One line about a lock record's holder: host, pid, rank, thread, phase, bytes, age."""
    if not record:
        return "unknown (no readable owner record)"
    age = time.time() - float(record.get("since", time.time()))
    done, total = record.get("bytes_done"), record.get("bytes_total")
    progress = f", {done}/{total} bytes" if done is not None else ""
    return (
        f"host {record.get('host')} pid {record.get('pid')} rank {record.get('rank')} "
        f"thread {record.get('thread')}, phase {record.get('phase')}{progress}, "
        f"held for {age:.0f}s (by its clock)"
    )


def holder_name(record: dict[str, Any] | None) -> str | None:
    """``"pid 77 on scnode2"`` for a lock holder's record (None: not known)."""
    if not record:
        return None
    return f"pid {record.get('pid')} on {record.get('host')}"


class RecordWatch:
    """Tracks, on this process's monotonic clock, when a holder's record last changed at
    all (liveness: lease renewals count) and when its progress last changed (stuckness)."""

    def __init__(self) -> None:
        self.raw: bytes | None = None
        self.record: dict[str, Any] | None = None
        self.changed_at = self.progressed_at = time.monotonic()
        self._progress: object = None

    def observe(self, raw: bytes | None, now: float) -> bool:
        """Note the holder's current record; True if it changed."""
        if raw == self.raw:
            return False
        self.raw = raw
        self.record = parse_record(raw)
        self.changed_at = now
        progress = _progress_of(self.record, raw)
        if progress != self._progress:
            self._progress = progress
            self.progressed_at = now
        return True

    def reset(self, now: float) -> None:
        self.raw, self.record, self._progress = None, None, None
        self.changed_at = self.progressed_at = now


def _progress_of(record: dict[str, Any] | None, raw: bytes | None) -> object:
    """What changes only when a holder makes progress (not when it merely renews)."""
    if record is None:
        return raw
    return tuple(record.get(k) for k in ("token", "phase", "bytes_done", "bytes_total"))
