"""The retry runner every retry loop calls (RetryPolicy.run): attempts, waits, the final error."""

from __future__ import annotations

import pytest

from shardcache._retry.policy import REFUSED_RETRIES, RetryPolicy, is_transient


class Flaky(Exception):
    pass


class Final(Exception):
    pass


def _failing(times: int, calls: list[int]):
    def attempt(n: int) -> str:
        calls.append(n)
        if n <= times:
            raise Flaky(f"attempt {n}")
        return f"done on {n}"

    return attempt


def test_retries_until_an_attempt_returns_and_waits_the_policy_delay() -> None:
    policy = RetryPolicy(retries=3, backoff=0.5, max_backoff=1.0)
    calls: list[int] = []
    retried: list[int] = []
    waits: list[float] = []
    result = policy.run(
        _failing(2, calls),
        retry_if=lambda exc: isinstance(exc, Flaky),
        give_up=lambda exc, n: Final(),
        on_retry=lambda exc, n: retried.append(n),
        wait=waits.append,
    )
    assert result == "done on 3" and calls == [1, 2, 3] and retried == [1, 2]
    assert 0.25 <= waits[0] <= 0.5 and 0.5 <= waits[1] <= 1.0  # full jitter of 0.5, 1.0


def test_gives_up_after_retries_plus_one_attempts_raising_from_the_last_failure() -> None:
    calls: list[int] = []
    given_up: list[int] = []

    def give_up(exc: Exception, n: int) -> BaseException:
        given_up.append(n)
        return Final(f"after {n}")

    with pytest.raises(Final) as info:
        RetryPolicy(retries=2).run(
            _failing(10, calls),
            retry_if=lambda exc: True,
            give_up=give_up,
            on_retry=lambda exc, n: None,
            wait=lambda seconds: None,
        )
    assert calls == [1, 2, 3] and given_up == [3] and str(info.value) == "after 3"
    assert isinstance(info.value.__cause__, Flaky) and str(info.value.__cause__) == "attempt 3"


def test_a_failure_not_retried_is_raised_unchanged_when_give_up_returns_it() -> None:
    calls: list[int] = []
    with pytest.raises(Flaky) as info:
        RetryPolicy(retries=5).run(
            _failing(10, calls),
            retry_if=lambda exc: False,
            give_up=lambda exc, n: exc,
            on_retry=lambda exc, n: pytest.fail("not retried"),
            wait=lambda seconds: pytest.fail("no wait"),
        )
    assert calls == [1] and info.value.__cause__ is None and str(info.value) == "attempt 1"


def test_a_base_exception_and_a_raising_wait_end_the_run_at_once() -> None:
    def cancelled(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        RetryPolicy(retries=5).run(
            cancelled,
            retry_if=lambda exc: True,
            give_up=lambda exc, n: pytest.fail("a BaseException is not judged"),
            on_retry=lambda exc, n: pytest.fail("a BaseException is not retried"),
        )

    def stop(seconds: float) -> None:
        raise Final("stopped while waiting")

    calls: list[int] = []
    with pytest.raises(Final, match="stopped while waiting"):
        RetryPolicy(retries=5).run(
            _failing(10, calls),
            retry_if=lambda exc: True,
            give_up=lambda exc, n: exc,
            on_retry=lambda exc, n: None,
            wait=stop,
        )
    assert calls == [1]


def _slowdown() -> Exception:
    from botocore.exceptions import ClientError

    body = {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}
    return ClientError(body, "GetObject")


def test_slowdown_refusals_do_not_use_up_retries_for_the_slowdown_time() -> None:
    """Refusals for the store's rate are retried without counting for ``slowdown_time``
    from the first one (on the run's clock); then each counts, and ordinary failures
    always do. ``n`` still counts every attempt (the backoff grows with it)."""
    now = [0.0]
    failures = iter([_slowdown()] * 6 + [Flaky("reset")] + [_slowdown()] * 10)
    calls: list[int] = []
    waits: list[float] = []

    def attempt(n: int) -> str:
        calls.append(n)
        now[0] += 10.0  # each refused attempt takes 10 s on the run's clock
        raise next(failures)

    def give_up(exc: Exception, n: int) -> BaseException:
        return Final(f"after {n}: {type(exc).__name__}")

    with pytest.raises(Final) as info:
        RetryPolicy(retries=2, backoff=0.5, slowdown_time=45.0).run(
            attempt,
            retry_if=lambda exc: True,
            give_up=give_up,
            on_retry=lambda exc, n: None,
            wait=waits.append,
            clock=lambda: now[0],
        )
    # Refusals at 10..50 s after the first (at 10 s): 10, 20, 30, 40 s in are free, the
    # one 50 s in (attempt 6) counts, the reset (7) counts, and the next refusal (8) is
    # the third that counts with retries=2: the run ends there.
    assert calls == list(range(1, 9)) and str(info.value) == "after 8: ClientError"
    assert max(waits) <= 30.0 and waits[-1] > waits[0]


def test_without_a_slowdown_time_every_refusal_counts() -> None:
    calls: list[int] = []

    def attempt(n: int) -> str:
        calls.append(n)
        raise _slowdown()

    with pytest.raises(Final):
        RetryPolicy(retries=1, slowdown_time=0.0).run(
            attempt,
            retry_if=lambda exc: True,
            give_up=lambda exc, n: Final(),
            on_retry=lambda exc, n: None,
            wait=lambda seconds: None,
        )
    assert calls == [1, 2]


@pytest.mark.parametrize(
    ("address", "attempts"),
    [("10.1.2.3", 1 + REFUSED_RETRIES), ("127.0.0.1", 1), ("::1", 1)],
    ids=["another-host", "loopback", "loopback-v6"],
)
def test_a_refused_connection_is_retried_at_most_twice_and_never_on_loopback(
    address: str, attempts: int
) -> None:
    calls: list[int] = []

    def refused(n: int) -> str:
        calls.append(n)
        raise ConnectionRefusedError(111, f"Connect call failed ('{address}', 9000)")

    with pytest.raises(ConnectionRefusedError):
        RetryPolicy(retries=5).run(
            refused,
            retry_if=is_transient,
            give_up=lambda exc, n: exc,
            on_retry=lambda exc, n: None,
            wait=lambda seconds: None,
        )
    assert calls == list(range(1, attempts + 1))
