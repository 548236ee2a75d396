"""``shardcache warm`` sent SIGTERM mid-download (``scancel``, a time limit, preemption): a
real ``python -m shardcache`` process, its download held mid-body by the fault proxy."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fswatch import TreeWatch, parts_under

from shardcache import ShardCache
from shardcache._base.safefs import SafeFS
from shardcache._base.trust import Trust
from shardcache._store.pins import is_held

BUCKET = "warm"
WAIT = 60.0


def big_parts(cache_dir: Path) -> list[Path]:
    """The download temp files below ``cache_dir`` but the cache directory's write check's."""
    return [p for p in parts_under(cache_dir) if not p.name.startswith(".write-check.")]


def _line_with(stream: object, text: str, timeout: float) -> list[str]:
    """Lines read from the pipe ``stream`` up to one containing ``text`` (bounded)."""
    lines: list[str] = []
    while not lines or text not in lines[-1]:
        assert select.select([stream], [], [], timeout)[0], f"no {text!r} within {timeout} s"
        line = stream.readline()  # type: ignore[attr-defined]
        assert line, f"stream ended before {text!r}: {lines}"
        lines.append(line)
    return lines


@pytest.mark.timeout(120)
def test_sigterm_mid_download_removes_the_part_and_exits_143(s3, fault_proxy, tmp_path) -> None:
    data = random.Random(3).randbytes(24 << 20)
    s3.put_objects(BUCKET, {"big.tar": data})
    url = f"s3://{BUCKET}/big.tar"
    # Headers and 1 MiB of the body, the rest once released: the warm is mid-download.
    held = fault_proxy.add_fault(
        "hold", times=1, method="GET", path_contains="big.tar", truncate_bytes=1 << 20
    )
    cache_dir = tmp_path / "cache"
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": fault_proxy.endpoint_url,
        "SHARDCACHE_DIR": str(cache_dir),
        "SHARDCACHE_CHUNK_SIZE": "64KiB",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcache", "warm", url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with TreeWatch(tmp_path) as watch:
            # big.tar's (the cache directory's write check makes a short-lived .part of its own)
            watch.wait_for(lambda: bool(big_parts(cache_dir)), WAIT, "the warm's .part")
        (part,) = big_parts(cache_dir)
        assert f".{proc.pid}." in part.name  # the warm's own temp file
        proc.send_signal(signal.SIGTERM)
        # Told once the downloads were told to stop: then the bytes may flow again (as on a
        # live link) and the download ends at its next ones.
        _line_with(proc.stderr, "warm: stopping", WAIT)
        held.release()
        out, err = proc.communicate(timeout=WAIT)
    finally:
        held.release()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert err.rstrip().splitlines()[-1] == "shardcache: terminated by SIGTERM (exit 143)", err
    assert not out  # no summary of a run that did not end
    scope = cache_dir / "rank-0"
    assert [p for p in (scope / "data").rglob("*") if not p.is_dir()] == []  # no .part, no shard
    # Its lock released: the lock file is held by no one, and a fetch takes it at once.
    fs = SafeFS(cache_dir, Trust.private())
    locks = list((scope / ".locks").rglob("*.lock"))
    assert locks and all(is_held(fs, lock) is False for lock in locks)
    cache = ShardCache(cache_dir, storage_options=s3.storage_options(), lock_timeout=5)
    assert cache.fetch(url).read_bytes() == data
    assert (cache.stats().misses, cache.stats().shared) == (1, 0)
