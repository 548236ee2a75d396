"""The in-order hash of a parallel download (``_hash_follower``): parts written in any order,
the follower hashes only the contiguous prefix, so its MD5 is the object's."""

from __future__ import annotations

import hashlib
import os
import random
import threading
from pathlib import Path

import pytest

from shardcache._transfer.checksums import Hasher
from shardcache._transfer.hash_follower import HashFollower, PartsWritten

PART = 100_000


def _file(tmp_path: Path, size: int) -> int:
    fd = os.open(tmp_path / "download.part", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)  # zeros until written, as a download's reserved file
    return fd


@pytest.mark.parametrize("order", [[2, 1, 0, 3], [0, 1, 2, 3], [3, 0, 2, 1]])
def test_parts_written_out_of_order_hash_as_the_object(tmp_path: Path, order: list[int]) -> None:
    data = random.Random(1).randbytes(3 * PART + 1234)
    ranges = [(start, min(start + PART, len(data))) for start in range(0, len(data), PART)]
    fd = _file(tmp_path, len(data))
    written = PartsWritten(ranges)
    follower = HashFollower(fd, len(data), Hasher("md5"), written)
    try:
        for part in order:  # each part in two writes, reported as it goes
            start, end = ranges[part]
            middle = (start + end) // 2
            for a, b in ((start, middle), (middle, end)):
                os.pwrite(fd, data[a:b], a)
                written.add(part, b, b - a)
        # Read too early, the zeros of an unwritten part would have been hashed instead.
        assert follower.digest() == hashlib.md5(data).hexdigest()
        assert written.value == len(data)
    finally:
        os.close(fd)


def test_an_abandoned_follower_stops_without_waiting_for_parts(tmp_path: Path) -> None:
    fd = _file(tmp_path, 4 * PART)
    written = PartsWritten([(i * PART, (i + 1) * PART) for i in range(4)])
    follower = HashFollower(fd, 4 * PART, Hasher("sha256"), written)
    try:
        os.pwrite(fd, b"x" * PART, PART)  # a later part only: nothing hashable yet
        written.add(1, 2 * PART, PART)
        done = threading.Event()
        threading.Thread(target=lambda: (follower.abandon(), done.set()), daemon=True).start()
        assert done.wait(10), "abandon() must return while parts are still missing"
    finally:
        os.close(fd)


def test_a_read_error_reaches_the_caller(tmp_path: Path) -> None:
    """The file ends before the prefix the parts report: the follower's error is raised by
    ``digest()`` (as the download's local I/O error), not lost in its thread."""
    fd = _file(tmp_path, PART)
    written = PartsWritten([(0, 2 * PART)])
    follower = HashFollower(fd, 2 * PART, Hasher("md5"), written)
    try:
        written.add(0, 2 * PART, 2 * PART)  # claims bytes the file does not have
        with pytest.raises(Exception, match="ended at byte"):
            follower.digest()
    finally:
        os.close(fd)
