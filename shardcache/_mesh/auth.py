"""Who may read from the mesh: the job key, and the signed header every request carries.

The job key is ``HMAC-SHA256(secret, "shardcache-mesh/" + job)``, so a key seen in one job
opens no other. A request is signed over its method, target, range, a timestamp and a nonce
(``t=<seconds>,n=<nonce>,s=<hex HMAC>``); the server refuses a timestamp off by more than
the allowed skew and a nonce seen within the window, before it reads anything from disk.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

HEADER = "X-Shardcache-Mesh"
MAX_SKEW = 30.0  # seconds a request's timestamp may differ from the server's clock
_MIN_SECRET = 16  # bytes
_SIGNED_RE = re.compile(r"t=(?P<t>[0-9]{1,12}),n=(?P<n>[0-9a-f]{32}),s=(?P<s>[0-9a-f]{64})")


class JobKey:
    """The key of one job's mesh, made from a secret shared by the job's processes."""

    def __init__(self, secret: bytes, job: str) -> None:
        if len(secret) < _MIN_SECRET:
            raise ValueError(f"a mesh secret needs at least {_MIN_SECRET} bytes, got {len(secret)}")
        self.job = job
        self._key = hmac.new(secret, f"shardcache-mesh/{job}".encode(), hashlib.sha256).digest()

    def _mac(self, method: str, target: str, byte_range: str, stamp: str, nonce: str) -> str:
        message = "\n".join((method, target, byte_range, stamp, nonce)).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign(self, method: str, target: str, byte_range: str = "", now: float | None = None) -> str:
        """The header value for a request of ``method`` on ``target`` (path and query, as
        sent) with the ``Range`` value ``byte_range`` ("" for none)."""
        stamp = str(int(time.time() if now is None else now))
        nonce = secrets.token_hex(16)
        return f"t={stamp},n={nonce},s={self._mac(method, target, byte_range, stamp, nonce)}"


class Verifier:
    """Checks signed requests for one job: signature, skew, and replays within the window.

    Thread-safe; remembers at most ``max_nonces`` nonces (the oldest forgotten first, and
    a forgotten nonce is outside the skew window by then unless the server is flooded, in
    which case the oldest are refused as stale rather than replayable: see ``check``)."""

    def __init__(
        self,
        key: JobKey,
        *,
        max_skew: float = MAX_SKEW,
        max_nonces: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = key
        self._max_skew = max_skew
        self._max_nonces = max_nonces
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._floor = 0.0  # requests stamped before this were forgotten: refused
        self._lock = threading.Lock()

    def check(self, method: str, target: str, byte_range: str, header: str | None) -> str | None:
        """None when the request is signed by the job's key, fresh and not a replay; else
        why it is refused (for the log and the answer; never which part differed)."""
        if not header:
            return "unsigned request"
        match = _SIGNED_RE.fullmatch(header.strip())
        if match is None:
            return "malformed signature header"
        expected = self._key._mac(method, target, byte_range, match["t"], match["n"])
        if not hmac.compare_digest(expected, match["s"]):
            return "signature does not match this job's key"
        stamp, now = int(match["t"]), self._clock()
        if abs(now - stamp) > self._max_skew:
            return (
                f"timestamp {stamp} is more than {self._max_skew:g} s from the server's {now:.0f}"
            )
        with self._lock:
            self._forget_before(now - self._max_skew)
            if stamp < self._floor or match["n"] in self._seen:
                return "replayed request"
            self._seen[match["n"]] = stamp
            while len(self._seen) > self._max_nonces:
                _, oldest = self._seen.popitem(last=False)
                self._floor = max(self._floor, oldest + 1)
        return None

    def _forget_before(self, limit: float) -> None:
        while self._seen:
            nonce, stamp = next(iter(self._seen.items()))
            if stamp >= limit:
                return
            del self._seen[nonce]
