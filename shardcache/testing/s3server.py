"""A moto S3 server in its own process, with exact per-request accounting.

Used by the test suite and by ``scripts/demo``. The server is ``python -m moto.server``
bound to 127.0.0.1; every request it serves is read back from its werkzeug access log
(stderr) so tests can assert exactly how many GETs a code path made::

    with S3Server() as s3:
        s3.put_objects("bkt", {"a.tar": b"..."})
        fs = s3fs.S3FileSystem(**s3.storage_options())
        fs.cat("bkt/a.tar")
        assert s3.count("GET", "bkt", "a.tar") == 1
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from shardcache._base.extras import require_extras
from shardcache.testing._service import HOST, S3Service, free_port, upload_multipart

logger = logging.getLogger(__name__)

ACCESS_KEY = "testing"
SECRET_KEY = "testing"

# Marker requests used by sync(); bucket names cannot contain "_", so no real request
# can ever share this prefix.
_SYNC_PREFIX = "/_shardcache_sync_/"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_LOG_RE = re.compile(
    r'^\S+ - - \[[^\]]*\] "(?P<method>[A-Z]+) (?P<target>.*) HTTP/\d(?:\.\d)?" '
    r"(?P<status>\d{3}) \S+\s*$"
)
# werkzeug escapes control characters as \xNN and backslashes as \\ in its log line.
_WERKZEUG_ESCAPE_RE = re.compile(r"\\(\\|x[0-9a-f]{2})")
_DEFAULT_PART_BUFFER = 5 * 1024 * 1024 - 1024  # moto's default in-memory key buffer


@dataclass(frozen=True)
class Request:
    """One request the server answered, as read from its access log."""

    method: str
    path: str
    """URL-decoded path without the query string, e.g. ``/bucket/dir/key``."""
    query: str
    """Raw query string (without ``?``), e.g. ``list-type=2&prefix=``."""
    status: int

    @property
    def bucket(self) -> str:
        """First path segment (path-style addressing)."""
        return self.path.lstrip("/").split("/", 1)[0]

    @property
    def key(self) -> str:
        """Everything after the bucket; ``""`` for bucket-level requests."""
        parts = self.path.lstrip("/").split("/", 1)
        return parts[1] if len(parts) > 1 else ""


def parse_log_line(line: str) -> Request | None:
    """Parse one werkzeug access-log line (ANSI colours allowed); ``None`` if it is not one."""
    match = _LOG_RE.match(_ANSI_RE.sub("", line).rstrip("\r\n"))
    if match is None:
        return None
    target = _WERKZEUG_ESCAPE_RE.sub(
        lambda m: "\\" if m.group(1) == "\\" else chr(int(m.group(1)[1:], 16)),
        match.group("target"),
    )
    path, _, query = target.partition("?")
    return Request(
        method=match.group("method"),
        path=unquote(path),
        query=query,
        status=int(match.group("status")),
    )


class S3Server(S3Service):
    """moto's S3 server in a child process on 127.0.0.1, with request counting.

    Args:
        port: Fixed port, or 0 to pick a free one (retried on a port clash).
        start_timeout: Seconds ``start()`` may take before raising ``TimeoutError``.
        min_part_size: moto's minimum size of non-final multipart parts. Defaults to
            1 byte so tests can build multipart objects from tiny parts (real S3: 5 MiB).
        extra_env: Additional environment variables for the server process.
    """

    access_key = ACCESS_KEY
    secret_key = SECRET_KEY

    def __init__(
        self,
        port: int = 0,
        *,
        start_timeout: float = 30.0,
        min_part_size: int = 1,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self._requested_port = port
        self._start_timeout = start_timeout
        self._min_part_size = min_part_size
        self._extra_env = dict(extra_env or {})
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._lifecycle_lock = threading.Lock()
        self._cond = threading.Condition()
        self._requests: list[Request] = []
        self._markers: set[str] = set()
        self._reader_done = True
        self._other_lines: deque[str] = deque(maxlen=200)

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> S3Server:
        """Start the server and wait until it answers (bounded by ``start_timeout``)."""
        require_extras("shardcache.testing.S3Server", "testing")
        with self._lifecycle_lock:
            if self._proc is not None:
                if self._proc.poll() is None:
                    return self
                self._terminate()  # it died: clean up and start afresh
            deadline = time.monotonic() + self._start_timeout
            attempts = 5 if self._requested_port == 0 else 1
            last_error = ""
            for attempt in range(1, attempts + 1):
                port = self._requested_port or free_port()
                self._spawn(port)
                outcome = self._wait_ready(deadline)
                if outcome is None:
                    atexit.register(self.stop)
                    logger.info("moto S3 server ready at %s", self.endpoint_url)
                    return self
                last_error = outcome
                self._terminate()
                logger.warning(
                    "moto S3 server on port %d failed to start (attempt %d/%d): %s",
                    port,
                    attempt,
                    attempts,
                    outcome,
                )
                if time.monotonic() >= deadline:
                    break
            raise RuntimeError(f"could not start the moto S3 server: {last_error}")

    def stop(self) -> None:
        """Terminate the server process and wait for it; safe to call repeatedly."""
        with self._lifecycle_lock:
            atexit.unregister(self.stop)
            self._terminate()

    def _spawn(self, port: int) -> None:
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            MOTO_PORT=str(port),
            S3_UPLOAD_PART_MIN_SIZE=str(self._min_part_size),
        )
        env.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(_DEFAULT_PART_BUFFER))
        env.update(self._extra_env)
        cmd = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
        with self._cond:
            self._requests.clear()
            self._markers.clear()
            self._other_lines.clear()
            self._reader_done = False
        self._port = port
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        self._reader = threading.Thread(
            target=self._read_log,
            args=(self._proc,),
            name=f"s3server-log-{port}",
            daemon=True,
        )
        self._reader.start()

    def _wait_ready(self, deadline: float) -> str | None:
        """Poll until a marker request round-trips through our log; error text on failure."""
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return f"process exited with {self._proc.returncode}: {self._log_tail()}"
            marker = uuid.uuid4().hex
            try:
                self._http("HEAD", _SYNC_PREFIX + marker, timeout=2.0)
            except OSError:
                # Not listening yet: give the child a moment (bounded by the deadline).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=0.05)
                continue
            if self._wait_marker(marker, timeout=5.0):
                return None
            return f"port {self._port} answered, but not by our server process"
        return f"not ready after {self._start_timeout:.0f}s: {self._log_tail()}"

    def _terminate(self) -> None:
        proc, reader = self._proc, self._reader
        self._proc = None
        self._reader = None
        self._port = None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if reader is not None:
            reader.join(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()

    def _log_tail(self) -> str:
        with self._cond:
            return " | ".join(list(self._other_lines)[-5:]) or "(no output)"

    def _read_log(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        try:
            for raw in iter(proc.stderr.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                req = parse_log_line(line)
                with self._cond:
                    if req is None:
                        self._other_lines.append(_ANSI_RE.sub("", line).rstrip())
                        logger.debug("moto: %s", line.rstrip())
                    elif req.path.startswith(_SYNC_PREFIX):
                        self._markers.add(req.path[len(_SYNC_PREFIX) :])
                    else:
                        self._requests.append(req)
                    self._cond.notify_all()
        except (OSError, ValueError):  # pipe closed under us by stop()
            pass
        finally:
            with self._cond:
                self._reader_done = True
                self._cond.notify_all()

    # ------------------------------------------------------------------ data helpers
    def reset(self) -> None:
        """Drop all buckets and objects (``POST /moto-api/reset``) and clear the counters."""
        status = self._http("POST", "/moto-api/reset", timeout=30.0)
        if status != 200:
            raise RuntimeError(f"moto reset answered HTTP {status}")
        self.sync()
        with self._cond:
            self._requests.clear()

    def put_objects(
        self,
        bucket: str,
        objects: Mapping[str, bytes],
        multipart_chunk: int | None = None,
    ) -> dict[str, str]:
        """Create ``bucket`` if missing and upload ``objects``; returns key -> ETag (unquoted).

        With ``multipart_chunk`` every object is uploaded as a multipart upload with
        parts of that size, so its ETag ends in ``-N``.
        """
        client = self.boto3_client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        etags: dict[str, str] = {}
        for key, data in objects.items():
            if multipart_chunk is None:
                etag = client.put_object(Bucket=bucket, Key=key, Body=data)["ETag"]
            else:
                etag = upload_multipart(client, bucket, key, data, multipart_chunk)["ETag"]
            etags[key] = etag.strip('"')
        return etags

    # ------------------------------------------------------------------ request log
    def _http(self, method: str, path: str, timeout: float) -> int:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until every request answered so far is in the counters.

        Sends a unique marker request and waits for its log line. werkzeug logs a request
        before it sends the response headers, so anything a client has already seen a
        response for is logged before the marker. Raises ``TimeoutError`` if not seen.
        """
        deadline = time.monotonic() + timeout
        marker = uuid.uuid4().hex
        self._http("HEAD", _SYNC_PREFIX + marker, timeout=timeout)
        if not self._wait_marker(marker, timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"S3Server.sync: marker request not logged within {timeout}s")

    def _wait_marker(self, marker: str, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(
                lambda: marker in self._markers or self._reader_done, timeout=timeout
            )
            found = marker in self._markers
            self._markers.discard(marker)
            return found

    def requests(
        self,
        method: str | None = None,
        path_prefix: str | None = None,
        *,
        sync: bool = True,
    ) -> list[Request]:
        """Requests served since the last ``reset()``, optionally filtered.

        ``path_prefix`` matches the decoded path (e.g. ``"/bkt/train-"``). Calls
        ``sync()`` first unless ``sync=False``.
        """
        if sync:
            self.sync()
        with self._cond:
            found = list(self._requests)
        if method is not None:
            found = [r for r in found if r.method == method.upper()]
        if path_prefix is not None:
            found = [r for r in found if r.path.startswith(path_prefix)]
        return found

    def count(
        self, method: str | None = None, bucket: str | None = None, key: str | None = None
    ) -> int:
        """Number of requests with this method on ``/bucket/key`` (``None`` = any); syncs."""
        return sum(
            1
            for r in self.requests(method)
            if (bucket is None or r.bucket == bucket) and (key is None or r.key == key)
        )

    def clear_requests(self) -> None:
        """Forget the requests counted so far (after a ``sync()``)."""
        self.sync()
        with self._cond:
            self._requests.clear()
