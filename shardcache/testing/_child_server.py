"""A server program run as a child process on loopback (the GCS emulator, Azurite, rclone,
SeaweedFS): found beside this interpreter or on PATH, started on free ports and waited for
(bounded, retried on other ports), stopped so that the process always ends and its state is
removed; its output kept in a log whose tail goes into every error.

:class:`ChildS3Server` adds what the S3 ones share: keys generated per server and a served
root."""

from __future__ import annotations

import abc
import atexit
import contextlib
import http.client
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar, TypeVar

from shardcache._base.errors import MissingExtraError
from shardcache.testing._service import HOST, LoopbackService, S3Service, free_port

_C = TypeVar("_C", bound="ChildServer")

_START_ATTEMPTS = 5  # a free port can be taken by someone else before the server binds it
_READY_POLL = 0.05  # seconds between readiness checks (a pause that ends if it exits)


def installed_program(name: str) -> str | None:
    """The executable ``name`` next to this interpreter (installed by pip), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


class ChildServer(LoopbackService):
    """A server program in a child process on 127.0.0.1; ``state`` is its own temporary
    directory (its working directory, its log, its data), removed by :meth:`stop`.

    Subclasses name the program (``program_name``, found by :meth:`program`) and give its
    command line (``_command``); a missing program makes :meth:`start` raise
    :class:`MissingExtraError` with ``install_hint``. ``_choose_port`` (one free port) and
    ``_not_ready`` (any HTTP answer) may be overridden.
    """

    program_name: str
    """The executable, for look-up, messages and the log's name."""
    install_hint = "pip install 'shardcache[testing]' (in a checkout: scripts/setup-venv)"
    graceful = True
    """``stop()`` sends SIGTERM and waits up to 5 s before SIGKILL (else SIGKILL at once)."""
    own_process_group = False
    """The server runs in its own process group, which ``stop()`` signals as a whole."""
    child_env: ClassVar[Mapping[str, str]] = MappingProxyType({})
    """Variables set for the child on top of this process's environment."""

    def __init__(self, *, start_timeout: float = 30.0) -> None:
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        # A short path: a Unix socket's has at most 107 bytes.
        self.state = Path(tempfile.mkdtemp(prefix=f"{self.program_name}-"))

    def program(self) -> str | None:
        """The executable (:func:`installed_program`), None when it is not installed."""
        return installed_program(self.program_name)

    @abc.abstractmethod
    def _command(self, program: str, port: int) -> list[str]:
        """The command line of ``program`` serving clients on ``port``."""

    def _choose_port(self) -> int:
        """The port clients reach, free now; a server that listens on more chooses them
        here too."""
        return free_port()

    def _not_ready(self) -> str:
        """ "" once the server is ready (it answers an HTTP request), else why not."""
        return "" if self._answers_http() else "no HTTP answer"

    @property
    def pid(self) -> int:
        """The server process's pid (only valid once started)."""
        if self._proc is None:
            raise RuntimeError(f"{type(self).__name__} is not running; call start() first")
        return self._proc.pid

    def start(self: _C) -> _C:
        """Start the server and wait until it is ready (bounded by ``start_timeout``); a
        port taken meanwhile by someone else is retried on others. A start that fails
        leaves nothing behind (as :meth:`stop`)."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        try:
            self._launch()
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)
        return self

    def _launch(self) -> None:
        """Run the program until it is ready, on other ports if it fails; else raise."""
        program = self.program()
        if program is None:
            raise MissingExtraError(
                f"shardcache.testing.{type(self).__name__} needs {self.program_name}, "
                f"which is not installed: {self.install_hint}",
                extra="testing",
                modules=[self.program_name],
            )
        env = {**os.environ, **self.child_env} if self.child_env else None
        deadline = time.monotonic() + self._start_timeout
        error = ""
        for _ in range(_START_ATTEMPTS):
            self.state.mkdir(parents=True, exist_ok=True)
            port = self._choose_port()
            command = self._command(program, port)
            with open(self._log, "ab") as log:
                self._proc = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    cwd=self.state,
                    env=env,
                    start_new_session=self.own_process_group,
                )
            self._port = port
            error = self._wait_ready(deadline)
            if not error:
                return
            self._terminate()
            if time.monotonic() >= deadline:
                break
        raise RuntimeError(f"{self.program_name} did not start: {error}")

    def stop(self) -> None:
        """End the server, wait for it (bounded) and remove its state; idempotent."""
        atexit.unregister(self.stop)
        self._terminate()
        shutil.rmtree(self.state, ignore_errors=True)

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines of the server's output, joined by " | "."""
        with contextlib.suppress(OSError):
            return " | ".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    @property
    def _log(self) -> Path:
        return self.state / f"{self.program_name}.log"

    def _wait_ready(self, deadline: float) -> str:
        """ "" once the server is ready, else why not (by ``deadline``)."""
        assert self._proc is not None
        why = "not checked"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return f"exited with {self._proc.returncode}: {self.log_tail()}"
            why = self._not_ready()
            if not why:
                return ""
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=_READY_POLL)
        return f"not ready after {self._start_timeout:.0f}s ({why}): {self.log_tail()}"

    def _answers_http(self) -> bool:
        """Whether the server answers an HTTP request (any answer: an S3 server's 403)."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=2.0)
        try:
            conn.request("GET", "/")
            conn.getresponse().read()
            return True
        except OSError:
            return False
        finally:
            conn.close()

    def _terminate(self) -> None:
        """End the process if any (``graceful``, ``own_process_group``) and wait for it;
        clear ``_proc`` and ``_port``."""
        proc, self._proc, self._port = self._proc, None, None
        if proc is None:
            return
        if self.graceful and proc.poll() is None:
            self._signal(proc, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
                return
        self._signal(proc, signal.SIGKILL)
        proc.wait(timeout=10)

    def _signal(self, proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        """Send ``sig`` to the process, or to its whole group (even once it exited)."""
        if not self.own_process_group:
            proc.send_signal(sig)  # nothing if it exited already
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


class ChildS3Server(ChildServer, S3Service):
    """An S3 server in a child process serving ``root`` (default a temporary directory,
    removed by :meth:`stop`), with keys generated per server (``access_key``,
    ``secret_key``)."""

    def __init__(self, root: Path | None = None, *, start_timeout: float = 30.0) -> None:
        super().__init__(start_timeout=start_timeout)
        self._owns_root = root is None
        self.root = (
            Path(tempfile.mkdtemp(prefix=f"{self.program_name}-root-")) if root is None else root
        )
        self.access_key = "SC" + secrets.token_hex(10).upper()
        self.secret_key = secrets.token_hex(20)

    def stop(self) -> None:
        """End the server, wait for it (bounded) and remove its state and a temporary
        root; idempotent."""
        super().stop()
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
