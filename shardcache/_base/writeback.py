"""Starting a file's write-back to disk while it is still being written (Linux
``sync_file_range``), so that the ``fsync`` before it is published waits only for the last
few MiB instead of the whole file."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from .redact import get_logger

logger = get_logger(__name__)

EVERY = 8 << 20  # bytes written between two starts of the write-back
_SYNC_FILE_RANGE_WRITE = 2  # start writing dirty pages not yet under write-out; do not wait


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux, or a C library without it
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_sync_file_range = _load_sync_file_range()


class WriteBehind:
    """Starts the write-back of ``fd`` each time ``EVERY`` more bytes of it were written.

    Only an optimisation: the caller still calls ``fsync``, which does whatever is left and
    reports any write error. Where the kernel or the file system refuses the call, it is
    not tried again for this file (and the ``fsync`` does all the work, as without it)."""

    def __init__(self, fd: int, every: int = EVERY) -> None:
        self._fd, self._every = fd, every
        self._started_at = 0  # bytes written when the write-back was last started
        self._works = _sync_file_range is not None

    def wrote(self, bytes_done: int) -> None:
        """``bytes_done`` bytes of the file are written now (a retry may start again at 0)."""
        self._started_at = min(self._started_at, bytes_done)
        if not self._works or bytes_done - self._started_at < self._every:
            return
        self._started_at = bytes_done
        assert _sync_file_range is not None
        if _sync_file_range(self._fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:  # 0, 0: whole file
            self._works = False
            logger.debug(
                "sync_file_range on fd %d failed (errno %d): the fsync before publishing "
                "writes the file back",
                self._fd,
                ctypes.get_errno(),
            )
