"""The process-wide SlowDown throttle: its rules (fake clock), the fault proxy's request-rate
mode, and many threads through the real pipeline against a rate-limited S3."""

from __future__ import annotations

import http.client
import itertools
import multiprocessing
import os
import re
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from botocore.exceptions import ClientError

from shardcache import ShardCache
from shardcache._retry.policy import is_throttled, is_transient
from shardcache._retry.throttle import BETA, FLOOR, GROWTH, Throttle, process_throttle
from shardcache.testing import FaultProxy, S3Server


class FakeTime:
    """A clock that only moves when a request sleeps or the test advances it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _throttle(max_rate: float | None = None) -> tuple[Throttle, FakeTime]:
    t = FakeTime()
    return Throttle(max_rate, clock=t.clock, sleep=t.sleep), t


def _error(status: int, code: str) -> ClientError:
    response = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "GetObject")  # type: ignore[arg-type]


def test_unthrottled_requests_never_wait() -> None:
    throttle, t = _throttle()
    for _ in range(100):
        throttle.acquire()
    assert t.slept == [] and throttle.rate is None and throttle.cuts == 0


def test_a_configured_rate_spaces_every_request() -> None:
    throttle, _ = _throttle(max_rate=10)
    sent = [throttle.acquire() for _ in range(5)]
    assert [round(b - a, 9) for a, b in itertools.pairwise(sent)] == [0.1] * 4
    assert throttle.rate == 10


def test_one_slowdown_cuts_the_process_rate_once_for_requests_already_sent() -> None:
    throttle, t = _throttle()
    sent = [throttle.acquire() for _ in range(32)]  # 32 requests at once, as 4 x 8 parts
    for at in sent:  # every one of them refused: one cut, not 32
        throttle.throttled(at)
    assert throttle.cuts == 1
    assert throttle.rate == pytest.approx(BETA * 32)
    before = t.now
    nxt = throttle.acquire()  # the next request waits a jittered fraction of a slot
    assert 0.5 / (BETA * 32) <= nxt - before <= 1.0 / (BETA * 32)
    throttle.throttled(nxt)  # a request sent after the cut, refused: cut again
    assert throttle.cuts == 2
    assert throttle.rate == pytest.approx(BETA * BETA * 32, rel=0.01)


def test_a_quiet_process_is_cut_from_the_floor_rate() -> None:
    throttle, _ = _throttle()
    throttle.throttled(throttle.acquire())
    assert throttle.rate == pytest.approx(BETA * FLOOR)


def test_the_rate_grows_back_with_every_answer_and_obeys_the_cap() -> None:
    throttle, _ = _throttle(max_rate=6)
    throttle.throttled(throttle.acquire())
    assert throttle.rate == pytest.approx(BETA * 6)  # half of what it was allowed
    for _ in range(5):
        throttle.succeeded()
    assert throttle.rate == pytest.approx(BETA * 6 * (1 + GROWTH) ** 5)
    for _ in range(100):
        throttle.succeeded()
    assert throttle.rate == 6  # grown past the cap: the cap holds
    unlimited, _ = _throttle()
    unlimited.throttled(unlimited.acquire())
    for _ in range(1000):
        unlimited.succeeded()
    assert unlimited.rate is None  # grown past RELEASE: no limit any more


def test_throttling_answers_are_recognised() -> None:
    for status, code in [(503, "SlowDown"), (429, "TooManyRequests"), (400, "Throttling")]:
        assert is_throttled(_error(status, code)), (status, code)
    wrapped = OSError("translated by s3fs")
    wrapped.__cause__ = _error(503, "SlowDown")
    assert is_throttled(wrapped) and is_transient(wrapped)
    for status, code in [(500, "InternalError"), (404, "NoSuchKey"), (403, "AccessDenied")]:
        assert not is_throttled(_error(status, code)), (status, code)
    assert not is_throttled(ConnectionResetError())


def test_one_throttle_per_process_and_rate() -> None:
    assert process_throttle(None) is process_throttle(None)
    assert process_throttle(5.0) is not process_throttle(None)


def test_a_job_rate_is_shared_by_the_ranks() -> None:
    throttle = Throttle(job_rate=80.0, world_size=8)
    assert throttle.rate == 10.0  # outside a DataLoader worker: one process per rank
    assert Throttle(4.0, job_rate=80.0, world_size=8).rate == 4.0  # the lower cap wins


class _WorkerCaps(torch.utils.data.IterableDataset):
    """Yields, in each DataLoader worker, the cap its cache's throttle resolves to."""

    def __init__(self, cache: ShardCache) -> None:
        self.cache = cache

    def __iter__(self) -> Iterator[float | None]:
        yield self.cache.remote.options.throttle.rate


def test_a_job_rate_is_shared_by_the_dataloader_workers(tmp_path: Path) -> None:
    """A cache made in the main process, copied into 2 DataLoader workers of rank 0 of 4:
    each worker sends at most 100 / (4 x 2) requests/s."""
    cache = ShardCache(tmp_path, job_request_rate=100, world_size=4, rank=0)
    loader = torch.utils.data.DataLoader(_WorkerCaps(cache), num_workers=2, batch_size=None)
    assert sorted(loader) == [12.5, 12.5]
    assert cache.remote.options.throttle.rate == 25.0  # the main process: no workers


def _child_view(throttle: Throttle, conn: Connection) -> None:
    conn.send((throttle.rate, throttle.cuts, throttle._lock.acquire(timeout=5)))


def test_a_forked_child_starts_its_copy_of_a_throttle_afresh() -> None:
    """A DataLoader worker forked from a process that was slowed down (or whose thread held
    the throttle's lock at the fork) sends its own requests unthrottled, never deadlocked."""
    throttle = Throttle()
    sent = throttle.acquire()
    throttle.throttled(sent)
    assert throttle.rate is not None and throttle.cuts == 1
    parent, child = multiprocessing.get_context("fork").Pipe()
    with throttle._lock:  # held by "another thread" at the fork
        proc = multiprocessing.get_context("fork").Process(
            target=_child_view, args=(throttle, child)
        )
        proc.start()
    try:
        assert parent.poll(30), "the child did not answer"
        assert parent.recv() == (None, 0, True)
    finally:
        proc.join(timeout=30)
    assert throttle.cuts == 1  # the parent's own state is untouched


# -------------------------------------------------------------- the fault proxy's rate mode


def test_proxy_rate_mode_answers_slowdown_above_the_rate(s3: S3Server) -> None:
    s3.put_objects("rate", {"a.bin": b"x" * 1000})
    # 0.001 requests/s refills nothing within the test: exactly the burst passes.
    with FaultProxy("127.0.0.1", s3.port, max_request_rate=0.001, request_burst=3) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        answers = []
        for method in ["GET", "GET", "HEAD", "GET", "HEAD"]:
            conn.request(method, "/rate/a.bin")
            response = conn.getresponse()
            answers.append((method, response.status, response.read()))
        conn.close()
        stats = proxy.stats()
    statuses = [status for _, status, _ in answers]
    assert 503 not in statuses[:3] and statuses[3:] == [503, 503]  # moto answered the burst
    assert re.search(rb"<Code>SlowDown</Code>", answers[3][2])  # S3's XML error body
    assert answers[4][2] == b""  # HEAD: no body
    assert (stats.rate_passed, stats.rate_refused) == (3, 2)
    assert stats.forwarded == 3 and stats.requests == 5


# -------------------------------------------------------------- the real pipeline

SHARDS = 96  # one GET each: about 5 s of the proxy's rate
THREADS = 12
LIMIT = 20.0  # requests/s the proxy lets through (a bucket of one second's worth)


def _fetch_all(tmp_path: Path, s3: S3Server, **settings: object) -> tuple[int, int]:
    blobs = {f"train-{i:04d}.tar": os.urandom(4096 + i) for i in range(SHARDS)}
    s3.put_objects("slow", blobs)
    with FaultProxy("127.0.0.1", s3.port, max_request_rate=LIMIT) as proxy:
        cache = ShardCache(
            tmp_path / "cache",
            storage_options={"endpoint_url": proxy.endpoint_url},
            retry_backoff=0.05,
            **settings,
        )
        urls = [f"s3://slow/{key}" for key in blobs]
        with cache.prefetch(urls, threads=THREADS, depth=2 * THREADS) as shards:
            for url, path in shards:
                assert path.read_bytes() == blobs[url.rsplit("/", 1)[1]]
        stats = proxy.stats()
    return stats.rate_passed, stats.rate_refused


@pytest.mark.timeout(120)
def test_many_threads_back_off_together_under_slowdown(s3: S3Server, tmp_path: Path) -> None:
    """12 prefetch threads against a store that takes 20 requests/s: every shard arrives
    intact, and the refusals stay few because one SlowDown slows all threads."""
    passed, refused = _fetch_all(tmp_path, s3)
    assert passed >= SHARDS  # one GET per shard
    # The first refusals hit the requests already in flight (one per thread); after that
    # the process sends below the limit and is refused again only when its growing rate
    # crosses it. Bounded by counts, not by time.
    assert refused <= THREADS + passed // 4, (passed, refused)


@pytest.mark.timeout(120)
def test_a_configured_rate_below_the_limit_is_never_refused(s3: S3Server, tmp_path: Path) -> None:
    """At most THREADS requests can be sent at once, and slots come LIMIT/2 a second: the
    proxy's bucket (LIMIT tokens, LIMIT a second) never runs dry, however the machine
    schedules the threads."""
    passed, refused = _fetch_all(tmp_path, s3, max_request_rate=LIMIT / 2)
    assert refused == 0 and passed >= SHARDS
