"""One retry policy object and the transient/permanent classification of remote errors."""

from __future__ import annotations

import asyncio
import errno
import random
import socket
from dataclasses import dataclass

from aiohttp import ClientError as AiohttpClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import HTTPClientError, IncompleteReadError, ReadTimeoutError

MAX_BACKOFF = 30.0

_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "BadGateway",
    "GatewayTimeout",
    "503",
    "500",
    "502",
    "504",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchVersion"}
_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.EREMOTEIO,
    errno.EAGAIN,
}

TRANSIENT, PERMANENT, NOT_FOUND = "transient", "permanent", "not found"


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of transient errors with exponential backoff and full jitter.

    ``retries`` is the number of *re*-tries: a request is attempted ``retries + 1`` times.
    """

    retries: int = 5
    backoff: float = 0.5
    max_backoff: float = MAX_BACKOFF

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        cap = min(self.max_backoff, self.backoff * (2 ** (attempt - 1)))
        return random.uniform(cap / 2, cap)

    def allows(self, attempt: int) -> bool:
        """May attempt number ``attempt + 1`` be made?"""
        return attempt <= self.retries


class TruncatedBody(ConnectionError):
    """The response ended before the object's size was reached."""


def _http_status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    return status, (str(code) if code is not None else None)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def classify(exc: BaseException) -> str:
    """TRANSIENT, PERMANENT or NOT_FOUND for an exception raised while fetching.

    Looks through the cause chain: s3fs translates botocore errors into OSError
    subclasses, keeping the original as ``__cause__``.
    """
    chain = _chain(exc)
    for item in chain:
        status, code = _http_status_and_code(item)
        if status is None and code is None:
            continue
        if code in _NOT_FOUND_CODES or status == 404:
            return NOT_FOUND
        if code in _TRANSIENT_CODES or status == 429 or (status is not None and status >= 500):
            return TRANSIENT
        return PERMANENT
    for item in chain:
        if isinstance(item, FileNotFoundError):
            return NOT_FOUND
        if isinstance(item, PermissionError):
            return PERMANENT
        if isinstance(
            item,
            TruncatedBody
            | TimeoutError
            | asyncio.TimeoutError
            | socket.timeout
            | ConnectionError
            | BotoConnectionError
            | HTTPClientError
            | IncompleteReadError
            | ReadTimeoutError
            | AiohttpClientError,
        ):
            return TRANSIENT
        if isinstance(item, OSError) and item.errno in _TRANSIENT_ERRNOS:
            return TRANSIENT
    return PERMANENT


def describe(exc: BaseException) -> str:
    """A one-line description of an error's most telling link in its chain."""
    for item in _chain(exc):
        status, code = _http_status_and_code(item)
        if status is not None or code is not None:
            message = getattr(item, "response", {}).get("Error", {}).get("Message", "")
            return f"HTTP {status} {code}: {message}".strip().rstrip(":")
    return f"{type(exc).__name__}: {exc}"
