"""Waiting for something to appear in a directory tree (a download's ``.part``) or for a
process to end, on the kernel's events (inotify, pidfd) rather than by polling."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import time
from collections.abc import Callable
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_IN_MODIFY, _IN_MOVED_TO, _IN_CREATE = 0x2, 0x80, 0x100


class TreeWatch:
    """inotify watches on ``root`` and on every directory made below it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._watched: set[str] = set()

    def __enter__(self) -> TreeWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def _watch_tree(self) -> None:
        for directory, _, _ in os.walk(self.root):
            if directory not in self._watched:
                mask = _IN_CREATE | _IN_MOVED_TO | _IN_MODIFY
                if _libc.inotify_add_watch(self.fd, os.fsencode(directory), mask) >= 0:
                    self._watched.add(directory)

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Until ``condition()`` holds, checked after each batch of events (and first), or
        AssertionError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self._watch_tree()  # first: what appears after the check wakes us up
            if condition():
                return
            left = deadline - time.monotonic()
            assert left > 0, f"not within {timeout} s: {what}"
            if select.select([self.fd], [], [], left)[0]:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.fd, 1 << 16):
                        pass


def wait_ended(pid: int, timeout: float) -> None:
    """Until process ``pid`` has ended (it may stay a zombie), or AssertionError."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        assert select.select([fd], [], [], timeout)[0], f"pid {pid} still runs after {timeout} s"
    finally:
        os.close(fd)


def parts_under(root: Path) -> list[Path]:
    """The download temp files (``*.part``) below ``root``."""
    return [p for p in root.rglob("*.part") if p.is_file()]
