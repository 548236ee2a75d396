"""The mesh's signed requests: only the job's key, fresh and once."""

from __future__ import annotations

import pytest

from shardcache._mesh.auth import JobKey, Verifier

SECRET = b"s" * 32
TARGET = "/v1/shard?scope=node&url=s3%3A%2F%2Fb%2Fk"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _verifier(clock: Clock, **kw) -> Verifier:
    return Verifier(JobKey(SECRET, "job-1"), clock=clock, **kw)


def test_a_request_signed_by_the_job_key_passes_once() -> None:
    clock = Clock(1_000_000.0)
    header = JobKey(SECRET, "job-1").sign("GET", TARGET, "bytes=0-9", now=clock.now)
    verifier = _verifier(clock)
    assert verifier.check("GET", TARGET, "bytes=0-9", header) is None
    assert verifier.check("GET", TARGET, "bytes=0-9", header) == "replayed request"


@pytest.mark.parametrize(
    ("key", "method", "target", "byte_range"),
    [
        (JobKey(b"t" * 32, "job-1"), "GET", TARGET, "bytes=0-9"),  # another secret
        (JobKey(SECRET, "job-2"), "GET", TARGET, "bytes=0-9"),  # another job
        (JobKey(SECRET, "job-1"), "GET", TARGET + "x", "bytes=0-9"),  # another target
        (JobKey(SECRET, "job-1"), "GET", TARGET, "bytes=0-99"),  # another range
        (JobKey(SECRET, "job-1"), "POST", TARGET, "bytes=0-9"),  # another method
    ],
)
def test_any_other_key_or_request_is_refused(key, method, target, byte_range) -> None:
    clock = Clock(1_000_000.0)
    header = key.sign(method, target, byte_range, now=clock.now)
    refused = _verifier(clock).check("GET", TARGET, "bytes=0-9", header)
    assert refused == "signature does not match this job's key"


def test_unsigned_and_malformed_headers_are_refused() -> None:
    verifier = _verifier(Clock(1_000_000.0))
    assert verifier.check("GET", TARGET, "", None) == "unsigned request"
    assert verifier.check("GET", TARGET, "", "t=1,n=zz,s=00") == "malformed signature header"


def test_a_stale_or_future_timestamp_is_refused() -> None:
    clock = Clock(1_000_000.0)
    key, verifier = JobKey(SECRET, "job-1"), _verifier(clock, max_skew=30)
    for offset in (-31, 31):
        refused = verifier.check("GET", TARGET, "", key.sign("GET", TARGET, now=clock.now + offset))
        assert refused is not None and refused.startswith("timestamp")
    assert verifier.check("GET", TARGET, "", key.sign("GET", TARGET, now=clock.now - 29)) is None


def test_a_flood_forgets_the_oldest_nonces_and_refuses_what_they_could_replay() -> None:
    clock = Clock(1_000_000.0)
    key, verifier = JobKey(SECRET, "job-1"), _verifier(clock, max_nonces=2)
    old = key.sign("GET", TARGET, now=clock.now - 5)
    assert verifier.check("GET", TARGET, "", old) is None
    for _ in range(2):
        assert verifier.check("GET", TARGET, "", key.sign("GET", TARGET, now=clock.now)) is None
    assert verifier.check("GET", TARGET, "", old) == "replayed request"  # forgotten, not replayable


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        JobKey(b"short", "job-1")
