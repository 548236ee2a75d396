"""A preempted job's leftovers: the ``.part`` of a download whose process was killed mid-body
(a DataLoader job SIGTERMed as SLURM does, a fetch SIGKILLed) is removed by the next fetch of
its shard into the same cache, and counts against SHARDCACHE_MAX_BYTES until then."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fswatch import TreeWatch, parts_under, wait_ended
from repo import ROOT

from shardcache import ShardCache
from shardcache._disk.layout import parse_temp_name
from shardcache._ops.demo import make_shard
from tools.processes import CTX

BUCKET = "preempt"
WAIT = 60.0
JOB = ROOT / "tests" / "support" / "stall_training_job.py"


def _held_part(watch_root: Path, cache_dir: Path, name: str) -> Path:
    """The ``.part`` of the shard ``name`` under ``cache_dir``, once there (watched from
    ``watch_root``)."""

    def held() -> list[Path]:
        return [p for p in parts_under(cache_dir) if p.name.startswith(f".{name}-")]

    with TreeWatch(watch_root) as watch:
        watch.wait_for(lambda: bool(held()), WAIT, f"a .part of {name}")
    (part,) = held()
    return part


@pytest.mark.timeout(180)
def test_a_sigtermed_dataloader_jobs_part_goes_at_the_next_fetch(s3, fault_proxy, tmp_path) -> None:
    shards = {f"train-{i:06d}.tar": make_shard(i, 4) for i in range(2)}
    s3.put_objects(BUCKET, shards)
    spec = f"s3://{BUCKET}/train-{{000000..000001}}.tar"
    held_url, held_data = f"s3://{BUCKET}/train-000001.tar", shards["train-000001.tar"]
    # DataLoader worker 1 downloads shard 1: held after 10 kB of its body, never released.
    fault_proxy.add_fault(
        "hold", times=1, method="GET", path_contains="train-000001", truncate_bytes=10_000
    )
    cache_dir = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, str(JOB), spec, str(cache_dir), fault_proxy.endpoint_url, "600", "600"],
        env={**os.environ, **s3.env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, as a job step's
    )
    try:
        part = _held_part(tmp_path, cache_dir, "train-000001")
        writer = parse_temp_name(part.name)
        assert writer is not None and writer.pid != proc.pid  # a DataLoader worker's
        os.killpg(proc.pid, signal.SIGTERM)  # what SLURM sends every process of the step
        proc.wait(WAIT)
        wait_ended(writer.pid, WAIT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGTERM
    assert part.exists()  # the dead worker's download, left behind
    # The next job fetches the same shard (same URL, same endpoint) into the same cache.
    cache = ShardCache(cache_dir, storage_options={"endpoint_url": fault_proxy.endpoint_url})
    assert cache.fetch(held_url).read_bytes() == held_data
    assert not part.exists()


def _fetch(endpoint: str, cache_dir: str, url: str, max_bytes: int) -> None:
    ShardCache(cache_dir, storage_options={"endpoint_url": endpoint}, max_bytes=max_bytes).fetch(
        url
    )


@pytest.mark.timeout(120)
def test_a_dead_downloads_part_counts_against_max_bytes_until_removed(
    s3, fault_proxy, tmp_path
) -> None:
    size = 1 << 20
    objects = {name: os.urandom(size) for name in ("a.tar", "b.tar", "c.tar")}
    s3.put_objects(BUCKET, objects)
    url = {name: f"s3://{BUCKET}/{name}" for name in objects}
    cache_dir = tmp_path / "cache"
    limit = size * 5 // 2  # room for two shards, not three
    cache = ShardCache(cache_dir, storage_options=s3.storage_options(), max_bytes=limit)
    cache.fetch(url["a.tar"])
    # A process killed mid-download of b.tar: its .part reserved b's full size.
    fault_proxy.add_fault("hold", times=1, method="GET", path_contains="b.tar")
    holder = CTX.Process(
        target=_fetch, args=(fault_proxy.endpoint_url, str(cache_dir), url["b.tar"], limit)
    )
    holder.start()
    try:
        part = _held_part(tmp_path, cache_dir, "b")
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(WAIT)
        wait_ended(holder.pid, WAIT)
    finally:
        if holder.is_alive():
            holder.kill()
            holder.join()
    assert part.stat().st_size == size  # reserved in full: it counts as a shard would
    # While some live process holds it (a DataLoader worker forked with the descriptor, a
    # writer in another pid namespace), it is not removed, and it counts: c.tar's room is
    # made by evicting a.tar.
    fd = os.open(part, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        cache.fetch(url["c.tar"])
        assert not cache.contains(url["a.tar"])
        assert parts_under(cache_dir) == [part]
    finally:
        os.close(fd)
    # Held by no one: the next room made removes it instead of evicting c.tar.
    assert cache.fetch(url["a.tar"]).read_bytes() == objects["a.tar"]
    assert cache.contains(url["c.tar"])
    assert parts_under(cache_dir) == []
    # The count behind max_bytes lost nothing: b.tar fits after evicting one shard.
    assert cache.fetch(url["b.tar"]).read_bytes() == objects["b.tar"]
    assert sum(p.stat().st_size for p in (cache_dir / "rank-0" / "data").rglob("*.tar")) == 2 * size
