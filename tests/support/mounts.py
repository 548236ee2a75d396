"""Real file-system conditions for tests: a small tmpfs that really fills, a read-only bind
mount. Both need root (``mount``); tests using them carry :data:`needs_root`. Tests on JuiceFS
(tools/juicefs.py) call :func:`require_fuse` first."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: mounts a tmpfs or a read-only bind mount"
)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. "2m") mounted at ``path`` for the ``with`` block."""
    path.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """``path`` bind-mounted read-only onto itself for the ``with`` block."""
    _run("mount", "--bind", str(path), str(path))
    try:
        _run("mount", "-o", "remount,ro,bind", str(path))
        yield path
    finally:
        _run("umount", "-l", str(path))


def fill(directory: Path, name: str = "filler") -> int:
    """Write into ``directory/name`` until the file system is full; returns bytes written."""
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    written = 0
    block = b"\0" * 4096
    try:
        while True:
            try:
                written += os.write(fd, block)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    return written
                raise
    finally:
        os.close(fd)


def require_fuse() -> None:
    """Skip the calling test when FUSE cannot be used; under SHARDCACHE_REQUIRE_SLURM=1 (CI)
    fail it instead, as the SLURM tests do."""
    # Imported here: tests/conftest.py imports this module, also where the repository's root
    # (and so ``tools``) is not on the path (scripts/check-dist tests an installed wheel).
    from tools.juicefs import fuse_unavailable

    reason = fuse_unavailable()
    if reason is not None:
        if os.environ.get("SHARDCACHE_REQUIRE_SLURM") == "1":
            pytest.fail(f"{reason} (required: SHARDCACHE_REQUIRE_SLURM=1)")
        pytest.skip(reason)
