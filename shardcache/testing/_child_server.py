"""The lifecycle shared by the S3 servers run from a binary in a child process (rclone,
SeaweedFS): generated keys, a state directory, a bounded start retried on other ports, and
a stop that always ends the process and removes what it made."""

from __future__ import annotations

import abc
import atexit
import contextlib
import http.client
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TypeVar

from shardcache._base.errors import MissingExtraError
from shardcache.testing._service import HOST, S3Service

_C = TypeVar("_C", bound="ChildS3Server")


class ChildS3Server(S3Service):
    """An S3 server in a child process on 127.0.0.1, serving ``root``.

    Subclasses name their binary (``binary``, ``binary_name``) and implement ``_spawn``
    (start the process on free ports, set ``_proc`` and ``_port``), ``_wait_ready`` and
    ``_terminate``; they log to ``_log``.
    """

    binary_name: str
    """The executable, for messages (``rclone``, ``weed``)."""

    def __init__(self, root: Path | None, start_timeout: float, prefix: str) -> None:
        self._owns_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix=f"{prefix}-")) if root is None else root
        self._start_timeout = start_timeout
        self.access_key = "SC" + secrets.token_hex(10).upper()
        self.secret_key = secrets.token_hex(20)
        self._proc: subprocess.Popen[bytes] | None = None
        # Log and other state: a short path (a Unix socket's has at most 107 bytes).
        self._state = Path(tempfile.mkdtemp(prefix=f"{prefix}-state-"))

    @staticmethod
    @abc.abstractmethod
    def binary() -> str | None:
        """The executable beside this interpreter or on PATH, else None."""

    @property
    def pid(self) -> int:
        """The server process's pid (only valid once started)."""
        if self._proc is None:
            raise RuntimeError(f"{type(self).__name__} is not running; call start() first")
        return self._proc.pid

    def start(self: _C) -> _C:
        """Start the server and wait until it is ready (bounded by ``start_timeout``); a
        port taken meanwhile by someone else is retried on others."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        binary = self.binary()
        if binary is None:
            raise MissingExtraError(
                f"shardcache.testing.{type(self).__name__} needs the {self.binary_name} "
                "binary, which is not installed (beside this interpreter or on PATH): pip "
                "install 'shardcache[testing]' (in a checkout: scripts/setup-venv)",
                extra="testing",
                modules=[self.binary_name],
            )
        deadline = time.monotonic() + self._start_timeout
        error = ""
        for _ in range(5):
            self._spawn(binary)
            error = self._wait_ready(deadline)
            if not error:
                atexit.register(self.stop)
                return self
            self._terminate()
            if time.monotonic() >= deadline:
                break
        raise RuntimeError(f"{self.binary_name} did not start: {error}")

    def stop(self) -> None:
        """End the server, wait for it (bounded) and remove its state and a temporary
        root; idempotent."""
        atexit.unregister(self.stop)
        self._terminate()
        shutil.rmtree(self._state, ignore_errors=True)
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    @abc.abstractmethod
    def _spawn(self, binary: str) -> None:
        """Start the process on free ports: set ``_proc`` and ``_port``."""

    @abc.abstractmethod
    def _wait_ready(self, deadline: float) -> str:
        """ "" once the server is ready, else why not (by ``deadline``)."""

    @abc.abstractmethod
    def _terminate(self) -> None:
        """End the process if any and wait for it; clear ``_proc`` and ``_port``."""

    def _answers_http(self) -> bool:
        """Whether the server answers an HTTP request (unsigned: any S3 answer, a 403)."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=2.0)
        try:
            conn.request("GET", "/")
            conn.getresponse().read()
            return True
        except OSError:
            return False
        finally:
            conn.close()

    @property
    def _log(self) -> Path:
        return self._state / f"{self.binary_name}.log"

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self._log.read_text(errors="replace").splitlines()[-5:])
        return "(no log)"
