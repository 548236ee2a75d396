"""The metadata record of a published shard (``.meta/<hh>/<name>.json``).

Written atomically (a temp file renamed into place) before the shard itself is published,
so a published shard's record describes it or a newer copy (``data_ino`` tells which);
read without following links, a missing or damaged record reads as empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from .layout import CacheLayout, meta_temp_path


def write_meta(layout: CacheLayout, final: Path, record: dict[str, Any]) -> None:
    """Write ``final``'s metadata record atomically (before ``final`` is published)."""
    write_record(layout, layout.meta_path(final), record)


def write_record(layout: CacheLayout, path: Path, record: dict[str, Any]) -> None:
    """Write the JSON record ``path`` inside the cache atomically (a temp file renamed)."""
    data = json.dumps(record, sort_keys=True)
    for attempt in range(1, 4):
        layout.make_dir(path.parent)
        tmp = meta_temp_path(path)
        try:
            fd = layout.fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                layout.trust.adopt_file(fd, layout.trust.file_mode)
                out.write(data)
            layout.fs.replace(tmp, path)
            return
        except FileNotFoundError:  # its directory was removed meanwhile: make it again
            with contextlib.suppress(OSError):
                layout.fs.unlink(tmp)
            if attempt == 3:
                raise


def read_meta_at(dir_fd: int, name: str) -> dict[str, Any]:
    """The record ``name`` in the metadata directory open as ``dir_fd`` (opened through the
    cache's SafeFS); {} when missing, unreadable or not a JSON object. For walks over a
    whole directory: one descriptor for all of its records."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        record = json.loads(os.read(fd, 1 << 16))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return record if isinstance(record, dict) else {}


def read_meta(layout: CacheLayout, final: Path) -> dict[str, Any]:
    """``final``'s metadata record; {} when it is missing, unreadable or not a JSON object."""
    try:
        record = json.loads(layout.fs.read_small(layout.meta_path(final)))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


__all__ = ["read_meta", "read_meta_at", "write_meta", "write_record"]
