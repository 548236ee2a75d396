"""Which file system a path lives on (from /proc/self/mountinfo), and whether it is networked.

flock on NFS/Lustre/GPFS may exclude only within one node without any error, so the lock
mode depends on this; the cache also warns when its directory is on a network file system.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# File system types whose flock cannot be trusted across nodes, or which are shared between
# nodes (so a "node-local" cache there is not node-local at all).
NETWORK_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "beegfs",
        "glusterfs",
        "afs",
        "9p",
        "panfs",
        "wekafs",
        "orangefs",
        "pvfs2",
        "ocfs2",
        "gfs2",
        "davfs",
        "juicefs",  # FUSE: fuse.juicefs
    }
)
MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class Mount:
    """One mount: where it is mounted, its type, source and options."""

    mount_point: str
    fstype: str
    source: str
    options: str

    @property
    def is_network(self) -> bool:
        """True for network/cluster file systems (and FUSE mounts of them)."""
        base = self.fstype.removeprefix("fuse.")
        return base in NETWORK_FS_TYPES or self.fstype in {"fuse.sshfs", "fuse.s3fs", "fuse"}

    def describe(self) -> str:
        return f"{self.fstype} at {self.mount_point} from {self.source} ({self.options})"


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    return field.encode().decode("unicode_escape") if "\\" in field else field


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse /proc/self/mountinfo lines (see proc(5))."""
    mounts = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        if not sep:
            continue
        fields, rest = head.split(), tail.split()
        if len(fields) < 6 or len(rest) < 2:
            continue
        options = fields[5] + ("," + rest[2] if len(rest) > 2 else "")
        mounts.append(Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]), options))
    return mounts


def mount_for(path: Path, mountinfo: str | None = None) -> Mount:
    """The mount containing ``path`` (the longest matching mount point; later mounts win)."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            mountinfo = ""
    target = _resolve(path)
    best: Mount | None = None
    for mount in parse_mountinfo(mountinfo):
        point = mount.mount_point.rstrip("/") or "/"
        inside = target == point or target.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = mount
    return best or Mount("/", "unknown", "unknown", "")


def _resolve(path: Path) -> str:
    """Resolve symlinks in the part of ``path`` that exists; keep the rest as written."""
    path = Path(os.path.abspath(path))
    missing: list[str] = []
    while not path.exists() and path != path.parent:
        missing.insert(0, path.name)
        path = path.parent
    return os.path.join(os.path.realpath(path), *missing)
