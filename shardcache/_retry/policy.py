"""One immutable retry policy that runs every retry loop, the transient/permanent
classification of remote errors, and the error raised when a fetch gives up.

Every loop that tries a remote operation again (a stat, a streamed GET, a part of a
parallel download, a ``pipe:`` command, a whole download that failed verification) is one
call of :meth:`RetryPolicy.run`, in the manner of urllib3's ``Retry``: the policy is a
frozen value, the call site says what may be retried, what to do before the next attempt
and which error ends it; the runner alone counts attempts and waits.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import random
import re
import socket
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import ClientError as AiohttpClientError
from aiohttp import ClientPayloadError, ServerDisconnectedError
from aiohttp import ClientResponseError as AiohttpResponseError
from botocore.exceptions import (
    ConnectionClosedError,
    HTTPClientError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from .._base.errors import (
    FetchError,
    IntegrityError,
    PermanentFetchError,
    RemoteIsADirectoryError,
    RemoteNotFoundError,
    RemotePermissionError,
    TransientFetchError,
)
from .._config.settings import SPECS
from .advice import missing_bucket_text, not_found_advice, refused_text

T = TypeVar("T")

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
# Answers that mean "too many requests" (S3's SlowDown; the AWS SDKs' throttling codes): the
# whole process slows down (shardcache._retry.throttle), besides the request's own retry.
_THROTTLING_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchVersion"}
_NO_BUCKET_CODES = {"NoSuchBucket", "ContainerNotFound"}  # S3's, Azure's
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

_DENIED_CODES = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch"}

TRANSIENT, PERMANENT, NOT_FOUND = "transient", "permanent", "not found"
DENIED, IS_A_DIRECTORY = "permission denied", "is a directory"
UNTRUSTED, REFUSED = "certificate rejected", "connection refused"
REFUSED_RETRIES = 2  # of a refused connection (a server restarting); none on loopback
_ADDRESS_RE = re.compile(r"\('([^']+)', \d+")  # asyncio's "Connect call failed ('h', port)"


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of transient errors with exponential backoff and full jitter.

    ``retries`` is the number of *re*-tries: a request is attempted ``retries + 1`` times,
    not counting the store's refusals for its request rate (:func:`is_throttled`) during
    ``slowdown_time`` from the first of them. A job start far above the store's limit is
    refused for a while however well its processes throttle themselves
    (docs/guides/at-scale.md); a shard must not fail for that, while a store that keeps
    refusing for longer still ends in an error.
    """

    retries: int = SPECS["retries"].default  # SHARDCACHE_RETRIES
    backoff: float = SPECS["retry_backoff"].default  # SHARDCACHE_RETRY_BACKOFF
    max_backoff: float = MAX_BACKOFF
    slowdown_time: float = SPECS["slowdown_retry_time"].default  # SHARDCACHE_SLOWDOWN_RETRY_TIME

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        cap = min(self.max_backoff, self.backoff * (2 ** (attempt - 1)))
        return random.uniform(cap / 2, cap)

    def allows(self, attempt: int) -> bool:
        """May another attempt be made after ``attempt`` failures that count?"""
        return attempt <= self.retries

    def counts(self, throttled: bool, refused_for: float) -> bool:
        """Whether a failure counts against ``retries``: any failure but a refusal for the
        store's rate within ``slowdown_time`` of the first refusal (``refused_for`` ago)."""
        return not throttled or refused_for >= self.slowdown_time

    def run(
        self,
        attempt: Callable[[int], T],
        *,
        retry_if: Callable[[Exception], bool],
        give_up: Callable[[Exception, int], BaseException],
        on_retry: Callable[[Exception, int], object],
        wait: Callable[[float], object] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> T:
        """Call ``attempt(1)``, ``attempt(2)``, ... until one returns; return its result.

        A failure (an ``Exception``: a ``BaseException`` such as a cancellation passes at
        once) is tried again when ``retry_if(exc)`` and the policy allows another attempt
        (:meth:`counts` says which failures use one up): then ``on_retry(exc, n)`` runs (it
        logs, and resets what the next attempt starts from) and ``wait(delay(n))`` (a
        ``wait`` may raise to stop early). Otherwise ``give_up(exc, n)`` names the error
        that ends the run: the failure itself is re-raised unchanged, any other error is
        raised from it. ``n`` counts every attempt.
        """
        n = counted = refusals = 0
        first_refusal: float | None = None
        while True:
            n += 1
            try:
                return attempt(n)
            except Exception as exc:
                throttled = is_throttled(exc)
                if throttled and first_refusal is None:
                    first_refusal = clock()
                refused_for = 0.0 if first_refusal is None else clock() - first_refusal
                counted += self.counts(throttled, refused_for)
                host = refused_host(exc)
                refusals += host is not None
                if not (
                    retry_if(exc)
                    and self.allows(counted)
                    and (host is None or refusals <= refused_retries(host))
                ):
                    error = give_up(exc, n)
                    if error is exc:
                        raise
                    raise error from exc
                on_retry(exc, n)
            wait(self.delay(n))


class TruncatedBody(ConnectionError):
    """The response ended before the object's size was reached."""


def _http_status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and error code an exception carries: botocore's ``response`` dict,
    aiohttp's ``ClientResponseError.status`` (fsspec's HTTP file system raises those), the
    Azure SDK's ``HttpResponseError`` (adlfs) or gcsfs's ``HttpError``."""
    if isinstance(exc, AiohttpResponseError):
        return exc.status, None
    store = _store_status_and_code(exc)
    if store is not None:
        return store
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code")
    return status, (str(code) if code is not None else None)


def _store_status_and_code(exc: BaseException) -> tuple[int | None, str | None] | None:
    """Status and code of an Azure SDK or gcsfs error; None for any other exception. Their
    modules are looked up, not imported: an error of theirs means they were imported."""
    azure = sys.modules.get("azure.core.exceptions")
    if azure is not None and isinstance(exc, azure.HttpResponseError):
        code = getattr(exc, "error_code", None)
        code = getattr(code, "value", code)
        status = getattr(exc, "status_code", None)
        return (status if isinstance(status, int) else None), (str(code) if code else None)
    gcs = sys.modules.get("gcsfs.retry")
    if gcs is not None and isinstance(exc, gcs.HttpError):
        return (exc.code if isinstance(exc.code, int) else None), None
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _kind_of_status(status: int | None, code: str | None) -> str:
    if code in _NOT_FOUND_CODES or status in (404, 410):
        return NOT_FOUND
    if code in _TRANSIENT_CODES or status in (408, 429) or (status is not None and status >= 500):
        return TRANSIENT
    if code in _DENIED_CODES or status in (401, 403):
        return DENIED
    return PERMANENT


def _kind_of_type(item: BaseException) -> str | None:
    if isinstance(item, ssl.SSLCertVerificationError):
        # Untrusted or mismatched certificate: aiohttp and botocore wrap it in connection
        # errors, but the same certificate is presented again on every attempt.
        return UNTRUSTED
    if isinstance(item, FileNotFoundError):
        return NOT_FOUND
    if isinstance(item, IsADirectoryError):
        return IS_A_DIRECTORY
    if isinstance(item, PermissionError):
        return DENIED
    if isinstance(item, ConnectionRefusedError) or (
        isinstance(item, OSError) and item.errno == errno.ECONNREFUSED
    ):
        return REFUSED
    if isinstance(item, _TRANSIENT_TYPES):
        return TRANSIENT
    if isinstance(item, OSError) and item.errno in _TRANSIENT_ERRNOS:
        return TRANSIENT
    return None


_TRANSIENT_TYPES = (
    TruncatedBody,
    TimeoutError,
    asyncio.TimeoutError,
    socket.timeout,
    socket.gaierror,  # a failed name lookup: resolvers fail transiently too
    ConnectionError,
    BotoConnectionError,
    HTTPClientError,
    IncompleteReadError,
    ReadTimeoutError,
    AiohttpClientError,
)


def _judge(exc: BaseException) -> tuple[str, BaseException]:
    """The kind of ``exc`` and the link of its cause chain that decided it.

    A status (botocore or aiohttp) anywhere in the chain decides first. Otherwise the
    deepest telling cause does: fsspec's HTTP file system raises ``FileNotFoundError``
    for *any* failed lookup, with the real error (refused, reset, DNS, timeout) as its
    cause, and s3fs translates botocore errors into ``OSError`` subclasses the same way.
    """
    chain = _chain(exc)
    for item in chain:
        status, code = _http_status_and_code(item)
        if status is not None or code is not None:
            return _kind_of_status(status, code), item
    for item in reversed(chain):
        kind = _kind_of_type(item)
        if kind is not None:
            return kind, item
    return PERMANENT, exc


def _code(exc: BaseException) -> str | None:
    """The store's error code that decided ``exc``'s kind, if any."""
    return _http_status_and_code(_judge(exc)[1])[1]


def refused_host(exc: BaseException) -> str | None:
    """The host that refused ``exc``'s connection ("" if it does not say), None if no
    connection was refused."""
    refused = False
    for item in _chain(exc):
        if not (
            isinstance(item, ConnectionRefusedError)
            or getattr(item, "errno", None) == errno.ECONNREFUSED
        ):
            continue
        refused = True
        host = getattr(item, "host", None)  # aiohttp's ClientConnectorError
        if isinstance(host, str) and host:
            return host
        if (found := _ADDRESS_RE.search(str(item))) is not None:
            return found.group(1)
    return "" if refused else None


def refused_retries(host: str) -> int:
    """How often a connection ``host`` refused is tried again (none on loopback)."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return 0 if loopback else REFUSED_RETRIES


def classify(exc: BaseException) -> str:
    """TRANSIENT, NOT_FOUND, DENIED, IS_A_DIRECTORY, UNTRUSTED, REFUSED or PERMANENT for an error
    raised while fetching, decided from its real cause (see :func:`_judge`)."""
    return _judge(exc)[0]


def describe(exc: BaseException) -> str:
    """A one-line description of the link of an error's chain that decided its kind."""
    item = _judge(exc)[1]
    status, code = _http_status_and_code(item)
    if isinstance(item, AiohttpResponseError):
        return f"HTTP {status} {item.message}".strip()
    if _store_status_and_code(item) is not None:
        return f"HTTP {status} {code or ''}: {_first_line(item)}".replace("  ", " ")
    if status is not None or code is not None:
        message = getattr(item, "response", {}).get("Error", {}).get("Message", "")
        return f"HTTP {status} {code}: {message}".strip().rstrip(":")
    return f"{type(item).__name__}: {' '.join(str(item).split())}"


def _first_line(exc: BaseException) -> str:
    """The first line of an Azure or GCS error's message (the rest: request ids, times and
    the response's XML), without the Azure SDK's wrapping."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    prefix = "Operation returned an invalid status "
    if message.startswith(prefix):
        message = message[len(prefix) :].strip("'")
    return message


def is_throttled(exc: BaseException) -> bool:
    """Whether the store refused ``exc``'s request for its rate: HTTP 429, or 503 / a
    throttling code (S3's ``SlowDown``) anywhere in the cause chain."""
    for item in _chain(exc):
        status, code = _http_status_and_code(item)
        if status in (429, 503) or code in _THROTTLING_CODES:
            return True
    return False


_TRUNCATED_TYPES = (TruncatedBody, IncompleteReadError, ClientPayloadError, ResponseStreamingError)
_RESET_TYPES = (
    ConnectionResetError,
    BrokenPipeError,
    ConnectionClosedError,
    ServerDisconnectedError,
)


def retry_cause(exc: BaseException) -> str:
    """Why a failed attempt is tried again, for the metrics: "integrity" (a failed
    verification: downloaded again), "slowdown" (:func:`is_throttled`), "5xx" (another
    server error), "truncated" (a body cut short), "reset" (the connection was reset or
    closed under the request), else "other" (timeouts, refused connections, ...)."""
    chain = _chain(exc)
    if any(isinstance(item, IntegrityError) for item in chain):
        return "integrity"
    if is_throttled(exc):
        return "slowdown"
    for item in chain:
        status, _code = _http_status_and_code(item)
        if status is not None and status >= 500:
            return "5xx"
    if any(isinstance(item, _TRUNCATED_TYPES) for item in chain):
        return "truncated"
    for item in chain:
        if isinstance(item, _RESET_TYPES):
            return "reset"
        if isinstance(item, OSError) and item.errno in (errno.ECONNRESET, errno.EPIPE):
            return "reset"
    return "other"


def is_transient(exc: BaseException) -> bool:
    """Whether trying again may help (:func:`classify` says TRANSIENT, or REFUSED: tried
    again at most :func:`refused_retries` times by :meth:`RetryPolicy.run`)."""
    return classify(exc) in (TRANSIENT, REFUSED)


def fetch_error(
    url: str,
    attempts: int,
    exc: BaseException,
    what: str = "download",
    endpoint: str | None = None,
) -> FetchError:
    """The :class:`FetchError` to raise for ``exc`` after ``attempts`` attempts to ``what``
    ``url``: its class and advice follow the kind of the error (:func:`classify`).
    ``endpoint`` says where requests for ``url`` go and where that was set (None: the
    store's default)."""
    kind, cause = classify(exc), describe(exc)
    if kind == REFUSED:
        host = refused_host(exc) or "?"
        tried = "not retried on loopback" if refused_retries(host) == 0 else f"{attempts} attempts"
        return PermanentFetchError(
            refused_text(url, what, f"{host} ({cause}; {tried})", endpoint),
            url=url,
            attempts=attempts,
            cause=cause,
            endpoint=endpoint,
            store_wide=True,  # every shard of this store would fail alike
        )
    if kind == NOT_FOUND:
        missing = _code(exc) in _NO_BUCKET_CODES
        return RemoteNotFoundError(
            missing_bucket_text(url, cause, endpoint)
            if missing
            else f"{url} does not exist ({cause}); failed at once, without retries. "
            f"{not_found_advice(url)}",
            url=url,
            attempts=attempts,
            cause=cause,
            store_wide=missing,
        )
    if kind == TRANSIENT and is_throttled(exc):
        return TransientFetchError(
            f"could not {what} {url}: {attempts} attempts failed, the store refusing them for "
            f"its request rate; last: {cause}. It kept refusing past "
            "SHARDCACHE_SLOWDOWN_RETRY_TIME and SHARDCACHE_RETRIES more: share its limit out "
            "ahead with SHARDCACHE_JOB_REQUEST_RATE (or SHARDCACHE_MAX_REQUEST_RATE), or "
            "raise SHARDCACHE_SLOWDOWN_RETRY_TIME.",
            url=url,
            attempts=attempts,
            cause=cause,
        )
    if kind == TRANSIENT:
        return TransientFetchError(
            f"could not {what} {url}: {attempts} attempts failed with transient errors; "
            f"last: {cause}. The store is overloaded or unreachable: retry later, or raise "
            "SHARDCACHE_RETRIES / SHARDCACHE_IO_TIMEOUT.",
            url=url,
            attempts=attempts,
            cause=cause,
        )
    if kind == DENIED:
        return RemotePermissionError(
            f"could not {what} {url}: permission denied ({cause}); failed at once, without "
            "retries. Check the credentials (AWS_* / storage_options; for Azure the "
            "account key, SAS token or connection string), the bucket policy or the "
            "file's permissions for this user.",
            url=url,
            attempts=attempts,
            cause=cause,
        )
    if kind == IS_A_DIRECTORY:
        return RemoteIsADirectoryError(
            f"{url} is a directory, expected a shard file; failed at once. List the shards "
            "(or use a brace pattern) instead.",
            url=url,
            attempts=attempts,
            cause=cause,
        )
    if kind == UNTRUSTED:
        return PermanentFetchError(
            f"could not {what} {url}: the server's TLS certificate was rejected ({cause}); "
            "failed at once, without retries: the same certificate comes back on every "
            "attempt. Check the host name in the URL, or make the certificate trusted "
            "(SSL_CERT_FILE for https://, AWS_CA_BUNDLE for s3://).",
            url=url,
            attempts=attempts,
            cause=cause,
        )
    return PermanentFetchError(
        f"could not {what} {url}: {cause}; not retried because retrying cannot fix it. "
        "Check credentials, permissions and the URL.",
        url=url,
        attempts=attempts,
        cause=cause,
    )
