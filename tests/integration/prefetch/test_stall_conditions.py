"""The stall watchdog under real conditions: a slow link, another process holding the
shard's lock, and a hung GET inside DataLoader worker processes.

Everything runs against the moto S3 server over HTTP through ``FaultProxy``, which shapes
the link (``conn_rate``) or hangs a request; processes are real (spawned or started with
``subprocess``). Every wait is bounded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import random
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from repo import SUPPORT

from shardcache import ShardCache, StallError, log_epoch_summary
from shardcache._ops.demo import make_shard
from shardcache._prefetch.prefetcher import Prefetcher
from shardcache.testing import FaultProxy
from tools.processes import CTX

BUCKET = "stall"
SLOW_RATE = 100_000  # bytes/s per connection: reads arrive in 16 KiB slices every ~0.16 s
WAIT = 60.0  # bound of every wait on another process
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def slow_proxy(s3) -> Iterator[FaultProxy]:
    """A proxy in front of the (reset) S3 server that caps each connection at SLOW_RATE."""
    with FaultProxy("127.0.0.1", s3.port, conn_rate=SLOW_RATE) as proxy:
        yield proxy


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class RecordingFetch:
    """Wraps ``ShardCache.fetch``: forwards every progress report and notes when it came."""

    def __init__(self, cache: ShardCache) -> None:
        self.cache = cache
        self.lock = threading.Lock()
        self.reports: dict[str, list[tuple[float, str, int]]] = defaultdict(list)

    def __call__(self, url: str, progress: Any) -> Path:
        def report(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
            with self.lock:
                self.reports[url].append((time.monotonic(), phase, bytes_done))
            progress(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)

        return self.cache.fetch(url, progress=report)

    def downloading(self, url: str) -> list[tuple[float, str, int]]:
        with self.lock:
            return [r for r in self.reports[url] if r[1] == "downloading"]


# -- a slow but moving link ------------------------------------------------------------


def test_a_slow_but_moving_link_is_not_a_stall_and_warns_of_starvation_once(
    s3, slow_proxy: FaultProxy, tmp_path: Path, caplog
) -> None:
    # Each shard takes ~3.5 s through the proxy, longer than the stall timeout; bytes
    # arrive every ~0.16 s, far inside it. The timeout leaves room for the prefetch
    # thread's first request (its own S3 client and connection: over 1 s once in CI).
    size, stall_timeout = 350_000, 2.5
    objects = {f"slow-{i}.tar": _blob(size, i) for i in range(3)}
    s3.put_objects(BUCKET, objects)
    urls = [f"s3://{BUCKET}/{key}" for key in objects]
    # The starvation monitor's evidence thresholds (5 shards over 10 s, made for
    # production) are shrunk so three slow shards are enough to judge; the share that
    # counts as starving and the one-warning-per-minute limit stay as they are.
    evidence = {"starvation_min_shards": 1, "starvation_min_span": 1.0}
    cache = ShardCache(
        tmp_path / "cache", storage_options={"endpoint_url": slow_proxy.endpoint_url}, retries=0
    )
    assert cache.settings.chunk_size == 8 << 20, "the default chunk: far bigger than a shard"
    fetch = RecordingFetch(cache)
    with caplog.at_level(logging.WARNING, logger="shardcache._prefetch.prefetcher"):
        shards = Prefetcher(
            fetch, urls, threads=1, depth=2, stall_timeout=stall_timeout, **evidence
        )
        got = [(url, path.read_bytes()) for url, path in shards]  # raises StallError if stalled
    assert got == [(f"s3://{BUCKET}/{key}", data) for key, data in objects.items()]
    for url in urls:
        reports = fetch.downloading(url)
        # Progress moved as bytes arrived, not once per 8 MiB chunk (one report at the end).
        assert len(reports) >= size // (64 << 10), (url, len(reports))
        assert reports[-1][0] - reports[0][0] > stall_timeout, "the condition: a slow download"
        assert s3.count("GET", BUCKET, url.rsplit("/", 1)[-1]) == 1, "no retry, no restart"
    warnings = [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "MB/s" in warnings[0] and "SHARDCACHE_THREADS" in warnings[0]
    report = log_epoch_summary(0)  # the loader report counts the warning, and no error
    assert (report["stall_warnings"], report["stall_errors"]) == (1, 0)


# -- a shard downloaded by another process ---------------------------------------------


def _node_cache(cache_dir: str, endpoint: str) -> ShardCache:
    return ShardCache(
        cache_dir, scope="node", storage_options={"endpoint_url": endpoint}, retries=0
    )


def _slow_holder(
    cache_dir: str, endpoint: str, url: str, waiter_ready: Any, downloading: Any, out: Any
) -> None:
    """Downloads ``url`` through the proxy, holding its lock throughout; sets
    ``downloading`` when the GET is about to be sent (phase "requesting": the lock is held
    by then)."""
    cache = _node_cache(cache_dir, endpoint)
    if not waiter_ready.wait(WAIT):
        raise TimeoutError("the waiting process never became ready")

    def report(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
        if phase == "requesting":
            downloading.set()

    path = cache.fetch(url, progress=report)
    out.put(("holder", os.getpid(), _sha256(path), cache.stats().as_dict()))


def _waiter(
    cache_dir: str,
    endpoint: str,
    url: str,
    stall_timeout: float,
    waiter_ready: Any,
    downloading: Any,
    out: Any,
) -> None:
    """Prefetches ``url`` once the holder is downloading it; reports what it got."""
    cache = _node_cache(cache_dir, endpoint)
    waiter_ready.set()
    if not downloading.wait(WAIT):
        raise TimeoutError("the holder never started downloading")
    try:
        got = [(u, _sha256(p)) for u, p in cache.prefetch([url], stall_timeout=stall_timeout)]
    except StallError as exc:
        out.put(("waiter", "StallError", str(exc), cache.stats().as_dict()))
        return
    out.put(("waiter", "ok", got, cache.stats().as_dict()))


def _holder_and_waiter(
    cache_dir: str, endpoint: str, url: str, stall_timeout: float, reports: int
) -> tuple[dict[str, tuple[Any, ...]], list[Any]]:
    """Run the holder and the waiter; collect ``reports`` results, then stop both."""
    waiter_ready, downloading, out = CTX.Event(), CTX.Event(), CTX.Queue()
    waiter = CTX.Process(
        target=_waiter,
        args=(cache_dir, endpoint, url, stall_timeout, waiter_ready, downloading, out),
    )
    holder = CTX.Process(
        target=_slow_holder, args=(cache_dir, endpoint, url, waiter_ready, downloading, out)
    )
    procs = [waiter, holder]
    for p in procs:
        p.start()
    try:
        results = {r[0]: r[1:] for r in (out.get(timeout=WAIT) for _ in range(reports))}
    except queue.Empty:
        pytest.fail("a process did not report")
    finally:
        waiter.join(WAIT)
        if reports < len(procs):
            holder.kill()  # stuck in its hung GET by design
        holder.join(WAIT)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(WAIT)
    return results, procs


def test_a_shard_another_process_is_downloading_keeps_the_watchdog_quiet(
    s3, slow_proxy: FaultProxy, tmp_path: Path
) -> None:
    # ~6.4 s through the proxy, more than twice the waiter's stall timeout. The waiter sees
    # the holder's record change every 0.5-1.5 s (record interval, lock poll backoff).
    data = _blob(700_000, 7)
    s3.put_objects(BUCKET, {"shared.tar": data})
    url = f"s3://{BUCKET}/shared.tar"
    stall_timeout = 3.0
    results, procs = _holder_and_waiter(
        str(tmp_path / "cache"), slow_proxy.endpoint_url, url, stall_timeout, reports=2
    )
    assert [p.exitcode for p in procs] == [0, 0]
    _pid, holder_sha, holder_stats = results["holder"]
    outcome, got, waiter_stats = results["waiter"]
    assert outcome == "ok", got  # got is the StallError's message otherwise
    assert got == [(url, hashlib.sha256(data).hexdigest())] and holder_sha == got[0][1]
    assert (holder_stats["misses"], holder_stats["shared"]) == (1, 0)
    assert (waiter_stats["misses"], waiter_stats["shared"]) == (0, 1), "waited, not fetched"
    assert waiter_stats["lock_wait_seconds"] > stall_timeout, "the condition: a long wait"
    assert s3.count("GET", BUCKET, "shared.tar") == 1


def test_a_lock_holder_whose_get_hangs_is_named_in_the_waiters_stall_error(
    s3, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    s3.put_objects(BUCKET, {"held.tar": _blob(100_000, 8)})
    url = f"s3://{BUCKET}/held.tar"
    fault_proxy.add_fault("hang", times=1, method="GET", path_contains="held.tar")
    stall_timeout = 2.0
    results, (waiter, holder) = _holder_and_waiter(
        str(tmp_path / "cache"), fault_proxy.endpoint_url, url, stall_timeout, reports=1
    )
    assert waiter.exitcode == 0 and fault_proxy.faults_injected("hang") == 1
    outcome, message, waiter_stats = results["waiter"]
    assert outcome == "StallError", message
    assert f"prefetch stalled: {url} made no progress" in message
    assert f"waiting for pid {holder.pid} on {socket.gethostname()}" in message
    assert "holds the shard's lock" in message and "shardcache status" in message
    assert waiter_stats["misses"] == 0, "the waiter never downloaded it itself"
    assert s3.count("GET", BUCKET, "held.tar") == 0, "the hung GET never reached the store"


# -- a hung GET inside DataLoader worker processes -------------------------------------

SHARDS, PER_SHARD = 8, 4
JOB = SUPPORT / "stall_training_job.py"


def test_a_hung_get_in_a_dataloader_worker_reaches_training_as_a_stall_error(
    s3, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": make_shard(i, PER_SHARD) for i in range(SHARDS)})
    spec = f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"
    # Rank 1 of 2 reads shards 1, 3, 5, 7; DataLoader worker 0 gets 1 and 5, worker 1 gets
    # 3 and 7. Shard 5's GET hangs: the stuck stage is worker 0 of rank 1, downloading.
    hung = f"s3://{BUCKET}/train-000005.tar"
    fault_proxy.add_fault("hang", times=1, method="GET", path_contains="train-000005")
    # The stall timeout leaves room for a fresh worker process to build its S3 client on a
    # loaded machine (seconds of CPU): the stall the test sees is the hung GET's.
    stall_timeout, io_timeout, bound = 8.0, 300.0, 100.0
    env = {
        **os.environ,
        **s3.env(),
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    args = [spec, str(tmp_path / "cache"), fault_proxy.endpoint_url, str(stall_timeout)]
    try:
        proc = subprocess.run(
            [sys.executable, str(JOB), *args, str(io_timeout)],
            env=env,
            check=False,  # the exit status is asserted below
            capture_output=True,
            text=True,
            timeout=bound,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the training process did not end within {bound}s: {exc.stderr}")
    # It ended long before the hung read's own timeout (io_timeout) could have freed it:
    # the loader shut down with a worker thread still blocked in the read.
    assert fault_proxy.faults_injected("hang") == 1
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr
    assert "epoch finished" not in proc.stdout
    # The training process got a StallError (torch rebuilt it from the worker's message).
    assert "\nshardcache.StallError: Caught StallError in DataLoader worker" in err, err
    assert f"prefetch stalled: {hung} made no progress" in err
    assert "DataLoader worker 0 of 2" in err and "rank 1/2" in err and "from torchrun" in err
    # The GET hung before its headers: the size is not known yet.
    assert "phase 'requesting'" in err and "bytes: 0 done of an unknown total" in err
    for hint in (
        "SHARDCACHE_IO_TIMEOUT",
        "SHARDCACHE_THREADS",
        "SHARDCACHE_PREFETCH_DEPTH",
        "SHARDCACHE_STALL_TIMEOUT",
    ):
        assert hint in err, hint
    # Samples of the shards before the hung one reached the training loop.
    keys = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("sample ")}
    assert {f"000001_{i:04d}" for i in range(PER_SHARD)} <= keys
    assert not any(k.startswith("000005_") for k in keys)
