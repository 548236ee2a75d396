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

The directories near the root that every path goes through (the scope, its ``data``,
``.meta`` and ``.locks``: ``REMEMBERED_DEPTH``) are remembered as descriptors once a walk
has checked them, so a hit walks only the last step (``data/<hh>``). A remembered
descriptor is used only if its name still leads to the very same directory (device and
inode) and the directory is still trusted; otherwise it is forgotten and the walk starts
from the root again. The descriptor keeps pointing at the directory the walk checked, so no
swap made since can redirect the operation; a directory removed and made again is a new
inode. Making directories (a miss) always walks from the root, checking every component.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import stat
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from .dirs import DIR_HINT, NOT_YET_ERRNOS, dir_error, ensure_dir, kind_of, not_a_dir, patience
from .errors import CacheDirError
from .trust import Trust

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Directories not visible yet (NFS), or removed again just after being made (a tmp
# cleaner), are made again with backoff for this long on a network file system (on a
# local one, dirs.LOCAL_PATIENCE).
MKDIR_TIMEOUT = 30.0
REMEMBERED_DEPTH = 2  # directories this deep below the root are remembered (scope/data, ...)
DIR_MEMO = 16  # directory descriptors a SafeFS keeps at most (oldest closed first)


_INSTANCES: weakref.WeakSet[SafeFS] = weakref.WeakSet()


def _new_locks_after_fork() -> None:
    for fs in list(_INSTANCES):
        fs._dirs_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_after_fork)


def _close_all(dirs: dict[str, tuple[int, int, int]]) -> None:
    for fd, _dev, _ino in dirs.values():
        with contextlib.suppress(OSError):
            os.close(fd)


class SafeFS:
    """Operations on absolute paths inside ``root`` (see the module docstring); at most
    ``dir_memo`` directory descriptors remembered. ``root_walks`` counts the walks that
    started from the root (a hit through remembered directories makes none)."""

    def __init__(self, root: Path, trust: Trust, *, dir_memo: int = DIR_MEMO) -> None:
        self.root = Path(root).absolute()
        self.trust = trust
        self.dir_memo = dir_memo
        self.root_walks = 0
        self._prefix = os.path.join(os.fspath(self.root), "")  # the root with a final "/"
        # path -> (descriptor, device, inode) of a directory the walk opened and checked.
        # Changed under the lock; read without it: a reader dups the descriptor and checks
        # the dup's identity, so a descriptor closed (and its number reused) meanwhile is
        # caught. A forked child gets a new lock (another thread may hold it at the fork).
        self._dirs: dict[str, tuple[int, int, int]] = {}
        self._dirs_lock = threading.Lock()
        _INSTANCES.add(self)
        weakref.finalize(self, _close_all, self._dirs)

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
        """``os.lstat`` of ``path``, resolved through its directory's descriptor."""
        with self.directory(path.parent) as dir_fd:
            return os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)

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
        start = time.monotonic()
        deadline: float | None = None  # set by the first "not yet" error
        delay = 0.005
        while True:
            try:
                return self._walk(path, parts, create=True)
            except CacheDirError:
                raise
            except OSError as exc:
                if deadline is None and exc.errno in NOT_YET_ERRNOS:
                    deadline = start + patience(path, MKDIR_TIMEOUT)[0]
                if exc.errno not in NOT_YET_ERRNOS or time.monotonic() >= (deadline or 0):
                    raise dir_error(path, exc, "creating") from exc
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)

    def _walk(self, path: Path, parts: list[str], *, create: bool) -> int:
        # Making directories (a miss) walks from the root: every component checked each time.
        fd, done = (None, 0) if create else self._remembered_ancestor(parts)
        if fd is None:
            fd = self._open_root(create)
            self.root_walks += 1
        current = "/".join([os.fspath(self.root), *parts[:done]])
        for depth in range(done, len(parts)):
            current = f"{current}/{parts[depth]}"
            fd = self._step(fd, parts[depth], current, create)  # closes the parent
            if depth < REMEMBERED_DEPTH:
                self._remember(current, fd)
        return fd

    # -- remembered directories ------------------------------------------------------------

    def _remembered_ancestor(self, parts: list[str]) -> tuple[int | None, int]:
        """A new descriptor of the deepest remembered directory on the way to ``parts``,
        and how many of them it resolves; (None, 0) if none can be used."""
        for depth in range(min(len(parts), REMEMBERED_DEPTH), 0, -1):
            fd = self._remembered("/".join([os.fspath(self.root), *parts[:depth]]))
            if fd is not None:
                return fd, depth
        return None, 0

    def _remembered(self, text: str) -> int | None:
        """A new descriptor of the remembered directory ``text``, if that name still leads to
        it and it is still trusted (else it is forgotten: the caller walks)."""
        entry = self._dirs.get(text)
        if entry is None:
            return None
        fd, dev, ino = entry
        try:
            st = os.lstat(text)
            if (st.st_dev, st.st_ino) != (dev, ino) or not self.trust.trusts_dir(st):
                raise FileNotFoundError(text)  # moved, removed and made again, or chmodded
            new = os.dup(fd)
        except OSError:
            self._forget(text, entry)
            return None
        try:
            st = os.fstat(new)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != (dev, ino):  # closed and reused meanwhile
            os.close(new)
            return None
        return new

    def _remember(self, text: str, fd: int) -> None:
        """Keep a copy of ``fd``, the walked (checked) directory ``text``."""
        try:
            st = os.fstat(fd)
            kept = os.dup(fd)
        except OSError:
            return
        with self._dirs_lock:
            if text not in self._dirs and len(self._dirs) >= self.dir_memo:
                os.close(self._dirs.pop(next(iter(self._dirs)))[0])  # the oldest
            previous = self._dirs.get(text)
            self._dirs[text] = (kept, st.st_dev, st.st_ino)
            if previous is not None:
                os.close(previous[0])  # walked again: the name led elsewhere meanwhile

    def _forget(self, text: str, entry: tuple[int, int, int]) -> None:
        """Drop ``entry`` if it is still what ``text`` maps to, closing its descriptor."""
        with self._dirs_lock:
            if self._dirs.get(text) is entry:
                del self._dirs[text]
                os.close(entry[0])

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
            try:
                st = os.stat(root)
            except FileNotFoundError:  # dangling: an error now, not ENOENT retried for 30 s
                raise not_a_dir(root, root) from None
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
