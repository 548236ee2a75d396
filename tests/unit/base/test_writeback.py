"""Starting a download's write-back early (``_base.writeback``): every ``EVERY`` bytes, again
after a retry starts over, never again once the kernel refused it."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from shardcache._base import writeback
from shardcache._base.writeback import WriteBehind

MiB = 1 << 20


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The sync_file_range calls made, each passed on to the real one."""
    real = writeback._sync_file_range
    if real is None:
        pytest.skip("this C library has no sync_file_range")
    made: list[tuple[int, ...]] = []

    def recorded(*args: int) -> int:
        made.append(args)
        return real(*args)

    monkeypatch.setattr(writeback, "_sync_file_range", recorded)
    return made


def _write(fd: int, behind: WriteBehind, start: int, stop: int) -> None:
    block = os.urandom(MiB)
    for done in range(start + MiB, stop + 1, MiB):
        os.pwrite(fd, block, done - MiB)
        behind.wrote(done)


def test_the_write_back_starts_every_few_mib_and_after_a_retry(
    tmp_path: Path, calls: list[tuple[int, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="shardcache")
    fd = os.open(tmp_path / "x.part", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        behind = WriteBehind(fd, every=4 * MiB)
        _write(fd, behind, 0, 10 * MiB)
        assert len(calls) == 2  # at 4 and 8 MiB: the last 2 are the fsync's
        assert all(call[0] == fd for call in calls)
        _write(fd, behind, 0, 5 * MiB)  # a retry from byte 0
        assert len(calls) == 3
        assert "sync_file_range" not in caplog.text  # the real call succeeded every time
    finally:
        os.close(fd)


def test_a_refused_call_is_not_made_again(
    calls: list[tuple[int, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    """A descriptor the kernel refuses sync_file_range for (a pipe: ESPIPE, as a file system
    without it would): tried once, logged with its errno, never tried again."""
    caplog.set_level(logging.DEBUG, logger="shardcache")
    read_end, fd = os.pipe()
    try:
        behind = WriteBehind(fd, every=MiB)
        for done in range(MiB, 6 * MiB + 1, MiB):
            behind.wrote(done)
        assert [call[0] for call in calls] == [fd]
        assert "the fsync before publishing writes the file back" in caplog.text
        assert f"errno {errno.ESPIPE}" in caplog.text
    finally:
        os.close(read_end)
        os.close(fd)
