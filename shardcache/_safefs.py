"""File operations below a cache root that no symbolic-link swap can redirect.

Every operation resolves its path from a descriptor of the cache root, one component at a
time, each opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to the previous one
(``dir_fd=``), and checked with ``fstat`` against the cache's :class:`Trust`. The final
name is then used relative to its directory's descriptor (``os.open(name, dir_fd=...)``,
``os.replace(src_dir_fd=..., dst_dir_fd=...)``, ...). A component swapped for a link at
any instant makes the operation fail (ELOOP/ENOTDIR, reported as :class:`CacheDirError`);
it never lands outside the root, and a foreign directory is refused before it is used.

The root itself is opened by its path (the user chose it, links included): it must be a
directory this cache trusts, and a link at the root's name must belong to the user or root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from ._dirs import DIR_HINT, NOT_YET_ERRNOS, dir_error, ensure_dir, kind_of, not_a_dir
from ._errors import CacheDirError
from ._trust import Trust

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Directories not visible yet (NFS), or removed again just after being made (a tmp
# cleaner), are made again with backoff for this long.
MKDIR_TIMEOUT = 30.0


class SafeFS:
    """Operations on absolute paths inside ``root`` (see the module docstring)."""

    def __init__(self, root: Path, trust: Trust) -> None:
        self.root = Path(root).absolute()
        self.trust = trust
        self._prefix = os.path.join(os.fspath(self.root), "")  # the root with a final "/"
        self._real_prefix: str | None = None  # the same, links resolved (the fast lstat)

    # -- directories ---------------------------------------------------------------------

    @contextlib.contextmanager
    def directory(self, path: Path, *, create: bool = False) -> Iterator[int]:
        """A descriptor of the directory ``path`` (the root or below), closed afterwards;
        with ``create``, missing components are made with the cache's mode and group."""
        fd = self._open_dir(path, create)
        try:
            yield fd
        finally:
            os.close(fd)

    def mkdirs(self, path: Path) -> None:
        """Make ``path`` and any missing component (the root too) with the cache's mode,
        each checked; ENOENT/ESTALE/EIO (NFS, a concurrent removal) retried with backoff."""
        with self.directory(path, create=True):
            pass

    def fsync_dir(self, path: Path) -> None:
        with self.directory(path) as fd:
            os.fsync(fd)

    # -- names in a directory ------------------------------------------------------------

    def open(self, path: Path, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of ``path`` through its directory's descriptor, never following a
        link at the final name either."""
        with self.directory(path.parent) as dir_fd:
            return os.open(path.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)

    def lstat(self, path: Path) -> os.stat_result:
        """``os.lstat`` of ``path``, resolved where the walk would resolve it.

        Fast path (every hit takes it): one ``O_PATH`` open by name, kept only if the kernel
        resolved it to the very place below the real root (``/proc/self/fd``), which no link
        on the way allows; anything else takes the descriptor walk."""
        st = self._lstat_resolved(path)
        if st is not None:
            return st
        with self.directory(path.parent) as dir_fd:
            return os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)

    def _lstat_resolved(self, path: Path) -> os.stat_result | None:
        text = os.fspath(path)
        if not text.startswith(self._prefix):
            return None
        try:
            fd = os.open(text, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None  # the walk says what is wrong
        try:
            if self._real_prefix is None:
                self._real_prefix = os.path.join(os.path.realpath(self.root), "")
            expected = self._real_prefix + text[len(self._prefix) :]
            if os.readlink(f"/proc/self/fd/{fd}") != expected:
                return None
            return os.fstat(fd)
        except OSError:
            return None
        finally:
            os.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        with self.directory(src.parent) as src_fd, self.directory(dst.parent) as dst_fd:
            os.replace(src.name, dst.name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)

    def link(self, src: Path, dst: Path) -> None:
        with self.directory(src.parent) as src_fd, self.directory(dst.parent) as dst_fd:
            os.link(src.name, dst.name, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)

    def unlink(self, path: Path) -> None:
        with self.directory(path.parent) as dir_fd:
            os.unlink(path.name, dir_fd=dir_fd)

    def read_small(self, path: Path, limit: int = 1 << 16) -> bytes:
        """The first ``limit`` bytes of a small file (a metadata or lock record), never
        blocking: a FIFO or device planted at its name (by a member of a shared cache, or by
        mistake) is an OSError, not a read that waits forever."""
        fd = self.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", str(path))
            return os.read(fd, limit)
        finally:
            os.close(fd)

    # -- the walk ------------------------------------------------------------------------

    def _parts(self, path: Path) -> list[str]:
        # String operations: this runs on every hit, where pathlib's parsing would dominate.
        text = os.fspath(path)
        if text == os.fspath(self.root):
            return []
        if not text.startswith(self._prefix):
            raise ValueError(f"{path} is not inside the cache root {self.root}")
        parts = text[len(self._prefix) :].split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{path} has empty, '.' or '..' components")
        return parts

    def _open_dir(self, path: Path, create: bool) -> int:
        parts = self._parts(path)
        if not create:
            return self._walk(path, parts, create=False)
        deadline = time.monotonic() + MKDIR_TIMEOUT
        delay = 0.005
        while True:
            try:
                return self._walk(path, parts, create=True)
            except CacheDirError:
                raise
            except OSError as exc:
                if exc.errno not in NOT_YET_ERRNOS or time.monotonic() >= deadline:
                    raise dir_error(path, exc, "creating") from exc
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)

    def _walk(self, path: Path, parts: list[str], *, create: bool) -> int:
        fd = self._open_root(create)
        current = os.fspath(self.root)
        for name in parts:
            current = f"{current}/{name}"
            fd = self._step(fd, name, current, create)  # closes the parent, come what may
        return fd

    def _open_root(self, create: bool) -> int:
        root = self.root
        try:
            link = os.lstat(root)
        except FileNotFoundError:
            if not create:
                raise
            ensure_dir(root, trust=self.trust)  # and its parents: nothing to walk from
            link = os.lstat(root)
        st = link
        if stat.S_ISLNK(link.st_mode):
            if link.st_uid not in (self.trust.uid, 0):
                self.trust.check_dir(root, link, root)  # its owner could repoint it any time
            st = os.stat(root)
        if not stat.S_ISDIR(st.st_mode):
            raise not_a_dir(root, root)
        self.trust.check_dir(root, st, root)  # before opening: says whose it is, not EACCES
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise not_a_dir(root, root) from None
        try:
            self.trust.check_dir(root, os.fstat(fd), root)  # what was opened, if swapped since
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _step(self, parent: int, name: str, path: str, create: bool) -> int:
        """Open ``name`` in ``parent`` (closing ``parent``) as a trusted real directory."""
        try:
            made = False
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, self.trust.dir_mode, dir_fd=parent)
                    made = True
                except FileExistsError:
                    pass  # another process made it first
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self._not_a_real_dir(parent, name, path) from None
                if exc.errno == errno.EACCES:  # someone else's? say whose, not just EACCES
                    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    self.trust.check_dir(Path(path), st, self.root)
                raise
        finally:
            os.close(parent)
        try:
            if made:
                self.trust.adopt_file(fd, self.trust.dir_mode)
            st = os.fstat(fd)
            if not self.trust.trusts_dir(st):
                self.trust.check_dir(Path(path), st, self.root)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _not_a_real_dir(self, parent: int, name: str, path: str) -> CacheDirError:
        try:
            seen = f"{kind_of(os.stat(name, dir_fd=parent, follow_symlinks=False))} at {path}"
        except OSError:
            seen = f"something that is not a directory at {path}"
        return CacheDirError(
            f"Refusing to use {path} inside the cache {self.root}: expected a directory, but "
            f"saw {seen} (a link there could redirect writes outside the cache). Remove it, "
            "or run 'shardcache clean'. " + DIR_HINT,
            path=str(path),
            expected="a directory",
            seen=seen,
            hint=DIR_HINT,
        )
