"""Judging a file of a cache directory stale or orphan (``status`` lists, ``clean`` removes).

What counts as stale (``clean`` removes exactly these, judging each again right before
removing it):

* a lease (``.locks/<hh>/<hash>.lease``) whose holder is provably dead (same host and
  boot, pid gone or reused), or that was written on another host and has not changed
  for ``OTHER_HOST_AGE`` (24 h);
* leftovers of lease operations (``<hash>.<token>.claim|.broken|.released``) whose
  process is dead (or, unreadable, older than ``OTHER_HOST_AGE``);
* a download's temp file (``.<name>.<host>.<pid>.<token>.part``) from this host whose pid
  no longer exists or now belongs to a process started after the file was last written,
  and that no process holds a ``flock`` on (:func:`shardcache._store.leftovers.dead_writer`);
  from another host, one untouched for ``OTHER_HOST_AGE``;
* a metadata record whose shard is gone and that no live download is about to publish,
  and a half-written metadata temp file older than ``META_TMP_AGE``;
* the same for a sample record (``.samples/``: the sample offsets learned of a cached
  shard), whose shard is gone.

Never touched: ``.lock`` files (deleting one lets two holders in), ``.owner`` records, a
lease of a live (or unjudgeable) holder, a temp file of a living process.
"""

from __future__ import annotations

import time
from pathlib import Path

from .._base.process_identity import hostname
from .._base.safefs import SafeFS
from .._disk.layout import (
    LEASE_STEPS,
    CacheLayout,
    host_tag,
    lease_step_of,
    meta_temp_pid,
    parse_temp_name,
)
from .._locking.records import holder_verdict, read_record
from .._store.eviction import list_dir
from .._store.leftovers import dead_writer
from .maintenance_reports import Leftover

OTHER_HOST_AGE = 24 * 3600.0  # a file of another host untouched this long is abandoned
META_TMP_AGE = 3600.0  # a metadata write takes milliseconds: an hour-old temp is abandoned


def rejudge(layout: CacheLayout, item: Leftover) -> Leftover | None:
    """``item`` judged again now, by the rule of its kind: stale still, or None."""
    if item.kind == "lease":
        return judge_lease(layout.fs, item.path)
    if item.kind in LEASE_STEPS:
        return judge_lock_leftover(layout.fs, item.path)
    if item.kind == "part":
        return judge_temp(layout.fs, item.path)
    return judge_record(layout, item.path)


def judge_lease(fs: SafeFS, path: Path) -> Leftover | None:
    """A stale lease (its holder dead, or of another host and silent), or None."""
    raw, record = read_record(fs, path)
    if raw is None:
        return None
    verdict, why = holder_verdict(record)
    if verdict == "dead":
        assert record is not None
        reason = f"lock of {record.get('url')}, holder pid {record.get('pid')}: {why}"
        return Leftover(path, "lease", len(raw), reason, raw)
    age = _age(fs, path)
    if record is not None and record.get("host") != hostname() and age > OTHER_HOST_AGE:
        reason = (
            f"lock of {record.get('url')}, holder on host {record.get('host')}, unchanged "
            f"for {age / 3600:.0f} h"
        )
        return Leftover(path, "lease", len(raw), reason, raw)
    return None


def judge_lock_leftover(fs: SafeFS, path: Path) -> Leftover | None:
    """A stale claim, broken or released lease file of a lease operation, or None."""
    raw, record = read_record(fs, path)
    if raw is None:
        return None
    kind = lease_step_of(path.name)
    assert kind is not None, path
    if record is None:
        age = _age(fs, path)
        if age > OTHER_HOST_AGE:
            return Leftover(path, kind, len(raw), f"unreadable, untouched for {age / 3600:.0f} h")
        return None
    verdict, why = holder_verdict(record)
    if verdict == "dead":
        reason = f"lock of {record.get('url')}, pid {record.get('pid')}: {why}"
        return Leftover(path, kind, len(raw), reason)
    age = _age(fs, path)
    if record.get("host") != hostname() and age > OTHER_HOST_AGE:
        return Leftover(
            path, kind, len(raw), f"host {record.get('host')}, untouched for {age / 3600:.0f} h"
        )
    return None


def judge_temp(fs: SafeFS, path: Path) -> Leftover | None:
    """An orphan download temp file, or None while its writer may be alive."""
    temp = parse_temp_name(path.name)
    if temp is None:
        return None
    try:
        st = fs.lstat(path)
    except OSError:
        return None
    if temp.host != host_tag():
        age = time.time() - st.st_mtime
        if age > OTHER_HOST_AGE:
            reason = f"written on host {temp.host}, untouched for {age / 3600:.0f} h"
            return Leftover(path, "part", st.st_size, reason)
        return None
    reason = dead_writer(fs, path, temp, st)
    return None if reason is None else Leftover(path, "part", st.st_size, reason)


def judge_record(layout: CacheLayout, path: Path) -> Leftover | None:
    """A metadata or sample record (or a temp file of one) that no shard needs."""
    fs = layout.fs
    writer = meta_temp_pid(path.name)
    if writer is not None:
        age = _age(fs, path)
        if age > META_TMP_AGE:
            reason = f"unfinished record write of pid {writer}, {age / 60:.0f} min old"
            return Leftover(path, "meta-tmp", file_size(fs, path), reason)
        return None
    if not path.name.endswith(".json") or path.name.startswith("."):
        return None
    kind = "samples" if path.parent.parent == layout.samples_dir else "meta"
    data = layout.data_path_of_record(path)
    if _exists(fs, data):  # the common case, one lstat (listing the bucket costs N/256)
        return None
    # Order matters: a download writes the record, then renames its temp file into place;
    # so no live download, then still no shard (it may have been renamed meanwhile).
    if _live_download_of(fs, data):
        return None
    if _exists(fs, data) or not _exists(fs, path):
        return None
    return Leftover(path, kind, file_size(fs, path), "its shard is no longer in the cache")


def _live_download_of(fs: SafeFS, data: Path) -> bool:
    for name, _ in list_dir(fs, data.parent, []):
        temp = parse_temp_name(name)
        live = temp is not None and temp.final == data.name
        if live and judge_temp(fs, data.parent / name) is None:
            return True
    return False


def file_size(fs: SafeFS, path: Path) -> int:
    """The size of ``path`` (not followed), 0 when it cannot be stat-ed."""
    try:
        return fs.lstat(path).st_size
    except OSError:
        return 0


def _age(fs: SafeFS, path: Path) -> float:
    try:
        return time.time() - fs.lstat(path).st_mtime
    except OSError:
        return 0.0


def _exists(fs: SafeFS, path: Path) -> bool:
    try:
        fs.lstat(path)
    except OSError:
        return False
    return True


__all__ = [
    "META_TMP_AGE",
    "OTHER_HOST_AGE",
    "file_size",
    "judge_lease",
    "judge_lock_leftover",
    "judge_record",
    "judge_temp",
    "rejudge",
]
