"""Remote faults through the fault-injecting proxy in front of a real S3 server: moto, and
SeaweedFS for every test whose requests reach the server."""

from __future__ import annotations

import hashlib
import logging
import random
import time
from pathlib import Path

import pytest
from servers import on_s3_servers
from torture_scale import scale

from shardcache import (
    PermanentFetchError,
    RemoteNotFoundError,
    ShardCache,
    StallError,
    TransientFetchError,
)
from shardcache.testing import SeaweedS3Server

BUCKET = "torture"
TRANSIENT_KINDS = ("reset", "status:500", "status:503", "truncate")


@pytest.fixture
def objects(s3) -> dict[str, bytes]:
    rng = random.Random("faults")
    n = scale(16, 120)
    data = {f"f-{i:05d}.tar": rng.randbytes(rng.randrange(20_000, 120_000)) for i in range(n)}
    s3.put_objects(BUCKET, data)
    return data


def _area(s3) -> str:
    """The figures' area: which server the faults were in front of."""
    return "remote faults" + (" (SeaweedFS)" if isinstance(s3, SeaweedS3Server) else "")


def _cache(tmp_path: Path, endpoint: str, **kw) -> ShardCache:
    kw.setdefault("retry_backoff", 0.01)
    return ShardCache(tmp_path / "cache", storage_options={"endpoint_url": endpoint}, **kw)


@on_s3_servers
def test_a_fifth_of_requests_faulted_every_shard_arrives_intact(
    s3, fault_proxy, objects, tmp_path: Path, figures
) -> None:
    rng = random.Random("fault-plan")
    # Each shard costs one GET; f faults add f retried requests. f = n/4 makes faults 20%
    # of all requests: f / (n + f) = 0.2.
    keys = list(objects)
    planned = len(keys) // 4
    for _ in range(planned):
        key, kind = rng.choice(keys), rng.choice(TRANSIENT_KINDS)
        fault_proxy.add_fault(kind, times=1, method="GET", path_contains=key)
    cache = _cache(tmp_path, fault_proxy.endpoint_url, retries=10)
    urls = [f"s3://{BUCKET}/{k}" for k in keys]
    with cache.prefetch(urls, threads=4, depth=8, stall_timeout=60) as shards:
        for url, path in shards:
            key = url.rsplit("/", 1)[1]
            assert (
                hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(objects[key]).digest()
            )
    stats = fault_proxy.stats()
    injected = sum(stats.faults.values())
    assert injected == planned, stats.faults
    ratio = injected / stats.requests
    assert 0.15 <= ratio <= 0.3, (injected, stats.requests)
    figures.add(
        _area(s3),
        f"{len(urls)} shards through the proxy, {injected} of {stats.requests} requests "
        f"({ratio:.0%}) faulted: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(stats.faults.items())),
        len(urls),
        "every shard delivered byte-identical (sha256); 0 errors",
    )


@on_s3_servers
@pytest.mark.parametrize("kind", ["reset", "status:500", "status:503", "truncate"])
def test_exhausted_retries_name_url_attempts_and_last_cause(
    s3, fault_proxy, objects, tmp_path: Path, kind: str, figures
) -> None:
    key = next(iter(objects))
    url = f"s3://{BUCKET}/{key}"
    method = "GET"
    fault_proxy.add_fault(kind, times=None, method=method, path_contains=key)
    # Every refusal an attempt: a SlowDown is otherwise retried for a while without
    # counting (test_retry.py and test_cache_s3.py cover that).
    cache = _cache(tmp_path, fault_proxy.endpoint_url, retries=3, slowdown_retry_time=0)
    with pytest.raises(TransientFetchError) as info:
        cache.fetch(url)
    exc = info.value
    msg = str(exc)
    assert exc.url == url and exc.attempts == 4 and exc.cause, msg
    assert url in msg and "4 attempts" in msg and exc.cause in msg
    # A reset on a kept-alive connection is retried once by aiohttp itself (observed: 8
    # requests for 4 attempts); anything beyond that would be a retry storm.
    requests = fault_proxy.faults_injected()
    assert 4 <= requests <= 8, requests
    assert not cache.contains(url) and not list((tmp_path / "cache").rglob("*.part"))
    figures.add(
        _area(s3),
        f"every GET answered with {kind}, retries=3"
        + (", SHARDCACHE_SLOWDOWN_RETRY_TIME=0" if kind == "status:503" else ""),
        1,
        f"TransientFetchError after 4 attempts ({requests} requests) naming the URL and the "
        f"last cause ({exc.cause})",
    )


@on_s3_servers
@pytest.mark.parametrize(
    ("case", "fault", "error"),
    [
        ("403 access denied", "status:403", PermanentFetchError),
        ("404 no such key", None, RemoteNotFoundError),
        ("no such bucket", None, RemoteNotFoundError),
    ],
)
def test_permanent_errors_fail_fast(
    s3, fault_proxy, objects, tmp_path: Path, case, fault, error, figures
) -> None:
    key = next(iter(objects))
    if case == "404 no such key":
        url = f"s3://{BUCKET}/missing-{key}"
    elif case == "no such bucket":
        url = f"s3://no-such-bucket-torture/{key}"
    else:
        url = f"s3://{BUCKET}/{key}"
        fault_proxy.add_fault(fault, times=None, path_contains=key)
    # A retry would sleep >= 2.5 s (backoff 5 s, jittered): fast means no retry at all.
    cache = _cache(tmp_path, fault_proxy.endpoint_url, retries=5, retry_backoff=5.0)
    started = time.monotonic()
    with pytest.raises(error) as info:
        cache.fetch(url)
    elapsed = time.monotonic() - started
    requests = fault_proxy.stats().requests
    # No retry: one attempt, one request (a retry would also sleep >= 2.5 s first).
    assert info.value.attempts == 1 and requests == 1, requests
    assert url in str(info.value) and "retr" in str(info.value)  # says it was not retried
    figures.add(
        _area(s3),
        f"{case} (retries=5, backoff 5 s)",
        1,
        f"{type(info.value).__name__} after 1 request in {elapsed:.2f}s, message names the URL "
        "and says it was not retried",
    )


def test_a_hanging_server_gives_stall_error_within_the_stall_timeout(
    s3, fault_proxy, objects, tmp_path: Path, figures, caplog
) -> None:
    key = next(iter(objects))
    fault_proxy.add_fault("hang", times=None, method="GET", path_contains=key)
    cache = _cache(tmp_path, fault_proxy.endpoint_url, io_timeout=600)
    stall = 2.0
    started = time.monotonic()
    urls = [f"s3://{BUCKET}/{key}"]
    with (
        pytest.raises(StallError) as info,
        cache.prefetch(urls, threads=1, stall_timeout=stall) as it,
    ):
        try:
            next(iter(it))
        finally:
            raised = time.monotonic() - started
    elapsed = time.monotonic() - started
    # The read could only time out after io_timeout (600 s): the StallError is the watchdog's.
    assert fault_proxy.faults_injected("hang") == 1
    # Leaving the block must not wait again for the worker the StallError already gave up
    # on: such a wait would end in the "still running ... after close" warning.
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and "after close" in r.message
    ]
    assert key in str(info.value)
    figures.add(
        "remote faults",
        f"GET that the server never answers (stall_timeout {stall:g}s, io_timeout 600 s)",
        1,
        f"StallError after {raised:.1f}s naming the shard; the block exited "
        f"{elapsed - raised:.1f}s later",
    )
