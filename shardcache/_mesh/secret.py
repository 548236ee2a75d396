"""The secret a job's mesh key is made from: the one the job was given
(``SHARDCACHE_MESH_SECRET``, which ``srun`` and torchrun carry to every task, and which another
user cannot read from a process's environment), else the user's own key file (made on first
use, readable by its owner only; shared by the nodes where the home directory is), and its
fingerprint, which the nodes compare through the job's store before any of them serves.

With neither, the mesh stays off and says how to turn it on. The key file is refused unless
it is a regular file owned by this user that no one else may read or write: another user's or
a readable key would let someone else into the mesh.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pwd
import secrets
import stat
from pathlib import Path

from .._base.errors import ConfigError

logger = logging.getLogger("shardcache.mesh")

SECRET_BYTES = 32
_MIN_BYTES = 16


def job_secret(given: str | None, key_file: Path) -> bytes | None:
    """The secret of this job's mesh: ``given`` (the ``mesh_secret`` setting, checked there),
    else the key file's (made when missing); None, with one warning naming the two ways to
    turn the mesh on, when neither is usable."""
    if given is not None:
        return given.encode()
    try:
        return key_file_secret(key_file)
    except (ConfigError, OSError) as exc:
        problem = str(exc) if isinstance(exc, ConfigError) else f"it cannot be made ({exc})"
        logger.warning(
            "the cache mesh stays off: no secret for it. The key file gave none: %s. Turn it "
            "on either way: export SHARDCACHE_MESH_SECRET for the job (the output of 'openssl "
            "rand -hex 32', before srun or torchrun), or let every node read the same key "
            "file %s (a home directory the nodes share, the file yours and mode 0600).",
            problem,
            key_file,
        )
        return None


def default_key_file() -> Path:
    """``~/.config/shardcache/mesh.key`` of the user running this process, the home directory
    from the password database (not ``$HOME``, which a job's environment may change)."""
    return Path(pwd.getpwuid(os.geteuid()).pw_dir) / ".config" / "shardcache" / "mesh.key"


def key_file_secret(path: Path) -> bytes:
    """The secret in the user's key file ``path``, made (mode 0600, its directory 0700) when
    missing; two processes making it at once end with the same one."""
    for _ in range(3):
        try:
            return _read(path)
        except FileNotFoundError:
            _make(path)
    return _read(path)


def fingerprint(secret: bytes) -> str:
    """What nodes compare to learn they hold the same secret, without revealing it."""
    return hashlib.sha256(b"shardcache-mesh-fingerprint\n" + secret).hexdigest()[:16]


def _refuse(path: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"The cache mesh's key file {path} {problem}; expected a file of yours that only you "
        f"may read (mode 0600). Remove it to have a new one made, or set "
        "SHARDCACHE_MESH_SECRET for the job.",
        name="mesh key file",
        value=str(path),
    )


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise _refuse(path, f"is not a regular file owned by uid {os.geteuid()}")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise _refuse(path, f"has mode {stat.S_IMODE(st.st_mode):o}: others may read it")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < _MIN_BYTES:  # made complete before it is linked: damaged, not unfinished
        raise _refuse(path, f"holds {len(data)} bytes, fewer than {_MIN_BYTES}")
    return data


def _make(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(SECRET_BYTES).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temp, path)  # never replaces a key another process made first
    except FileExistsError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)
