"""FaultProxy's link shaping: latency and bandwidth caps (lower bounds only)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardcache._base.token_bucket import TokenBucket
from shardcache.testing import FaultProxy

BUCKET = "shape"


def _get(s3, endpoint: str, key: str) -> tuple[bytes, float]:
    client = s3.boto3_client(endpoint_url=endpoint)
    t0 = time.monotonic()
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    return body, time.monotonic() - t0


def test_token_bucket_paces_takers() -> None:
    bucket = TokenBucket(1_000_000, burst=1000)
    t0 = time.monotonic()
    for _ in range(10):
        bucket.take(25_000)
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(ValueError):
        TokenBucket(0)


def test_latency_and_per_connection_rate(s3) -> None:
    data = b"x" * 1_000_000
    s3.put_objects(BUCKET, {"a": data})
    with FaultProxy("127.0.0.1", s3.port, latency=0.15) as proxy:
        body, took = _get(s3, proxy.endpoint_url, "a")
        assert body == data and took >= 0.15
    with FaultProxy("127.0.0.1", s3.port, conn_rate=4_000_000) as proxy:
        body, took = _get(s3, proxy.endpoint_url, "a")
        assert body == data and took >= 0.2  # 1 MB at 4 MB/s


def test_total_rate_is_shared_by_connections(s3) -> None:
    data = b"y" * 500_000
    s3.put_objects(BUCKET, {f"k{i}": data for i in range(4)})
    with FaultProxy("127.0.0.1", s3.port, total_rate=4_000_000) as proxy:
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: _get(s3, proxy.endpoint_url, f"k{i}"), range(4)))
        assert all(body == data for body, _ in results)
        assert time.monotonic() - t0 >= 0.4  # 2 MB at 4 MB/s in total
        proxy.add_fault("status:503", times=1)  # faults still work on a shaped proxy
        with pytest.raises(Exception, match=r"503|SlowDown"):
            s3.boto3_client(
                endpoint_url=proxy.endpoint_url, retries={"total_max_attempts": 1}
            ).get_object(Bucket=BUCKET, Key="k0")
