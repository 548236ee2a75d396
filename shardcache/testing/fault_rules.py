"""What :class:`~shardcache.testing.FaultProxy` injects: fault rules (kind, how many
times, which requests), the record of each fault applied, the proxy's counters, and the
S3-style error responses of ``status:NNN`` faults."""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

FAULT_KINDS = ("status", "reset", "truncate", "corrupt", "hang", "hold", "headers")

# S3 error code and message per status for injected "status:NNN" faults.
_S3_ERRORS = {
    400: ("BadRequest", "Bad Request"),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    429: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    502: ("BadGateway", "Bad Gateway"),
    503: ("SlowDown", "Please reduce your request rate."),
    504: ("GatewayTimeout", "Gateway Timeout"),
}


@dataclass
class FaultRule:
    """Apply ``kind`` to the next ``remaining`` requests matching method and path.

    ``remaining=None`` means every matching request, forever.
    """

    kind: str
    remaining: int | None = 1
    method: str | None = None
    path_contains: str | None = None
    status: int = 503
    truncate_bytes: int | None = None
    """Body bytes to forward before closing (``truncate``); default half the body."""
    corrupt_at: int | None = None
    """Offset of the body byte inverted (``corrupt``); default the middle of the body.
    With ``hold``, a byte after the held part inverted when the rest is sent; default none."""
    released: threading.Event = field(default_factory=threading.Event, repr=False)
    """``hold``: set it (:meth:`release`) to send the rest of the held bodies."""

    def release(self) -> None:
        """``hold``: send the rest of every body this rule holds back."""
        self.released.set()

    error_code: str | None = None
    """S3 error code in the XML body (``status``); default depends on the status."""
    set_headers: dict[str, str] = field(default_factory=dict)
    """``headers``: response headers replaced (or added) with these values."""
    range_from: int | None = None
    """Match only requests whose ``Range`` header starts at this byte (a ranged GET of
    one part of a parallel download); ``0`` also matches a request without ``Range``."""
    injected: int = 0

    @property
    def label(self) -> str:
        """``"status:503"``, ``"reset"``, ``"truncate"``, ``"corrupt"`` or ``"hang"``."""
        return f"status:{self.status}" if self.kind == "status" else self.kind

    def matches(self, method: str, target: str, byte_range: str | None = None) -> bool:
        """Whether this rule applies to a request (``target`` is the decoded URL,
        ``byte_range`` its ``Range`` header)."""
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self.range_from is not None and _range_start(byte_range) != self.range_from:
            return False
        return self.path_contains is None or self.path_contains in target


def _range_start(byte_range: str | None) -> int:
    """The first byte a ``Range: bytes=N-...`` header asks for (0 without one)."""
    if not byte_range:
        return 0
    first = byte_range.partition("=")[2].partition("-")[0]
    return int(first) if first.isdigit() else -1


@dataclass(frozen=True)
class InjectedFault:
    """One fault the proxy applied."""

    kind: str
    method: str
    target: str


@dataclass(frozen=True)
class ProxyStats:
    """Snapshot of a proxy's counters."""

    connections: int
    requests: int
    forwarded: int
    faults: dict[str, int]
    injected: tuple[InjectedFault, ...]
    rate_passed: int = 0
    """Requests the request-rate limit (``max_request_rate``) let through."""
    rate_refused: int = 0
    """Requests it answered with 503 SlowDown."""


class FaultRules:
    """Thread-safe ordered list of fault rules; the first matching rule wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []

    def add(self, rule: FaultRule) -> FaultRule:
        """Append a rule and return it."""
        if rule.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {rule.kind!r}; expected one of {FAULT_KINDS}")
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule."""
        with self._lock:
            self._rules.clear()

    def pending(self) -> list[FaultRule]:
        """Rules that can still fire."""
        with self._lock:
            return [r for r in self._rules if r.remaining is None or r.remaining > 0]

    def take(self, method: str, target: str, byte_range: str | None = None) -> FaultRule | None:
        """Consume one use of the first rule matching this request, if any."""
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, target, byte_range):
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    rule.injected += 1
                    return rule
        return None


def parse_kind(kind: str) -> tuple[str, int]:
    """``"status:503"`` -> ``("status", 503)``; other kinds get status 0."""
    name, _, arg = kind.partition(":")
    if name == "status":
        if not arg.isdigit() or not 100 <= int(arg) <= 599:
            raise ValueError(f"bad status fault {kind!r}; expected e.g. 'status:503'")
        return name, int(arg)
    if name not in FAULT_KINDS or arg:
        raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
    return name, 0


def s3_error_response(status: int, code: str | None = None, head_only: bool = False) -> bytes:
    """A complete HTTP/1.1 response carrying an S3-style XML error."""
    default_code, message = _S3_ERRORS.get(
        status, ("InternalError" if status >= 500 else "InvalidRequest", "Injected fault")
    )
    request_id = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code or default_code}</Code><Message>{message}</Message>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        f"Date: {formatdate(usegmt=True)}\r\n"
        "Server: shardcache-faultproxy\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    ).encode()
    return head if head_only else head + body
