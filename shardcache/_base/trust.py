"""Who a cache trusts, and the modes it creates things with.

A cache is **private** by default: the root and every directory below it must be owned by
this process's user and writable by no one else, and shardcache creates directories 0700
and files 0600. Anyone else who could write there could replace a shard (poison training
data) or plant a link that redirects our writes, so anything else is refused with a
:class:`CacheDirError`, and a cached file that is not ours is never served.

A **shared** cache (``SHARDCACHE_SHARED_GROUP``) extends that trust to one group, chosen
deliberately: directories are group-owned, setgid (new entries inherit the group) and
group-writable (2770), shards and records group-readable (0640), lock files group-writable
(0660). A member of the group can therefore replace any shard: the group must be people
whose data you would train on anyway. Writable by others is refused in both modes.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import CacheDirError, ConfigError

PRIVATE_HINT = (
    "Remove it if it is yours (another user may have made it to plant data in your cache), "
    "or point SHARDCACHE_DIR at a directory you own; a cache shared by a team on purpose "
    "needs SHARDCACHE_SHARED_GROUP."
)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "unknown user"


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return "unknown group"


def describe_owner(st: os.stat_result) -> str:
    """``owned by uid 1001 (alice), group 1001 (alice), mode 0o775``."""
    return (
        f"owned by uid {st.st_uid} ({user_name(st.st_uid)}), group {st.st_gid} "
        f"({group_name(st.st_gid)}), mode {oct(stat.S_IMODE(st.st_mode))}"
    )


def group_id(group: str | int, label: str = "SHARDCACHE_SHARED_GROUP") -> int:
    """The gid of a group given by name or number; ConfigError if there is no such group."""
    text = str(group).strip()
    try:
        gid = int(text) if text.isdigit() else grp.getgrnam(text).gr_gid
        grp.getgrgid(gid)
    except (KeyError, OverflowError):
        raise ConfigError(
            f"{label}={group!r} names no group on this host; expected a group name or gid "
            "(see getent group) whose members share the cache.",
            name=label,
            value=group,
        ) from None
    return gid


@dataclass(frozen=True)
class Trust:
    """The user (and optionally one group) a cache trusts; see the module docstring."""

    uid: int
    gid: int | None = None  # the shared group, None for a private cache

    @classmethod
    def private(cls) -> Trust:
        return cls(os.geteuid())

    @classmethod
    def for_group(cls, group: str | int | None) -> Trust:
        """Trust for ``SHARDCACHE_SHARED_GROUP=group`` (a name or a numeric gid); the
        process must be a member, or it could not write the shared directories."""
        if group is None:
            return cls.private()
        gid = group_id(group)
        if gid != os.getegid() and gid not in os.getgroups():
            raise ConfigError(
                f"SHARDCACHE_SHARED_GROUP={group!r}: this process (uid {os.geteuid()}, "
                f"{user_name(os.geteuid())}) is not a member of group {gid} "
                f"({group_name(gid)}), so it could not use a cache shared by that group. "
                "Ask for membership (then log in again), or unset it for a private cache.",
                variable="SHARDCACHE_SHARED_GROUP",
                value=group,
                gid=gid,
            )
        return cls(os.geteuid(), gid)

    @property
    def shared(self) -> bool:
        return self.gid is not None

    @property
    def dir_mode(self) -> int:
        return 0o2770 if self.shared else 0o700

    @property
    def file_mode(self) -> int:
        """Shards, temp files and metadata records."""
        return 0o640 if self.shared else 0o600

    @property
    def lock_mode(self) -> int:
        """Lock files and lock records: every member opens them for writing."""
        return 0o660 if self.shared else 0o600

    def _trusted(self, st: os.stat_result) -> bool:
        mode = stat.S_IMODE(st.st_mode)
        ours = self.shared and st.st_gid == self.gid  # the shared group's
        if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not ours):
            return False  # writable by others, or by a group we do not trust
        return st.st_uid == self.uid or ours

    def trusts_dir(self, st: os.stat_result) -> bool:
        """Whether a directory may hold the cache (:meth:`check_dir` says why not)."""
        return self._trusted(st)

    def trusts_file(self, st: os.stat_result) -> bool:
        """Whether a cached file may be served: ours (or the group's), writable by no other."""
        return self._trusted(st)

    def check_dir(self, path: Path, st: os.stat_result, root: Path) -> None:
        """Raise CacheDirError unless the directory ``path`` (stat ``st``) may hold the cache."""
        if self.trusts_dir(st):
            return
        if self.shared:
            expected = (
                f"owned by uid {self.uid} ({user_name(self.uid)}) or by group {self.gid} "
                f"({group_name(self.gid)}) and not writable by others"
            )
            hint = (
                "Remove it, or make it the group's: chgrp "
                f"{group_name(self.gid)} DIR && chmod 2770 DIR (as its owner)."
            )
        else:
            expected = (
                f"owned by uid {self.uid} ({user_name(self.uid)}) and writable by no one else"
            )
            hint = PRIVATE_HINT
        seen = describe_owner(st)
        raise CacheDirError(
            f"Refusing to use {path} in the cache {root}: expected a directory {expected}, "
            f"but it is {seen}. {hint}",
            path=str(path),
            expected=expected,
            seen=seen,
            owner=st.st_uid,
            group=st.st_gid,
            mode=stat.S_IMODE(st.st_mode),
            hint=hint,
        )

    def adopt_dir(self, path: Path) -> None:
        """Give a directory we just made the cache's mode (and group): mkdir's mode is cut
        by the umask, and the setgid bit is not taken from it."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self.adopt_file(fd, self.dir_mode)
        finally:
            os.close(fd)

    def adopt_file(self, fd: int, mode: int) -> None:
        """Give what ``fd`` opens (made by us) ``mode`` whatever the umask and, in a shared
        cache, the group (a setgid parent gives it that already)."""
        if self.gid is not None and os.fstat(fd).st_gid != self.gid:
            os.fchown(fd, -1, self.gid)
        os.fchmod(fd, mode)


__all__ = ["Trust", "describe_owner"]
