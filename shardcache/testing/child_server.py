"""A loopback server run as a child process: found on disk, started on a free port, waited
for (bounded) until it answers HTTP, stopped with SIGTERM (then SIGKILL)."""

from __future__ import annotations

import abc
import atexit
import contextlib
import http.client
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from shardcache._base.errors import MissingExtraError
from shardcache.testing._service import HOST, LoopbackService


def free_port() -> int:
    """A port nothing listens on now (another process may take it before we bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class ChildServer(LoopbackService):
    """A server program in a child process on 127.0.0.1; ``state`` is its own temporary
    directory (its log, its data), removed by :meth:`stop`.

    Subclasses give the program (:meth:`command`; None when it is not installed, and then
    :meth:`start` raises :class:`MissingExtraError` with :attr:`install_hint`)."""

    name = "server"
    install_hint = ""
    graceful = True  # stop() sends SIGTERM first (else SIGKILL at once)

    def __init__(self, *, start_timeout: float = 30.0) -> None:
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self.state = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))

    @abc.abstractmethod
    def command(self, port: int) -> list[str] | None:
        """The command line that serves on ``port``; None if the program is not installed."""

    @property
    def pid(self) -> int:
        """The server process's pid (only valid once started)."""
        if self._proc is None:
            raise RuntimeError(f"{type(self).__name__} is not running; call start() first")
        return self._proc.pid

    def start(self) -> ChildServer:
        """Start the server and wait until it answers HTTP (bounded by ``start_timeout``)."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        if self.command(0) is None:
            raise MissingExtraError(
                f"{type(self).__name__} needs {self.name}, which is not installed: "
                f"{self.install_hint}",
                extra="testing",
                modules=[self.name],
            )
        deadline = time.monotonic() + self._start_timeout
        error = ""
        for _ in range(5):  # a free port can be taken before the server binds it
            port = free_port()
            command = self.command(port)
            assert command is not None
            with open(self._log, "ab") as log:
                self._proc = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=self.state
                )
            self._port = port
            error = self._wait_ready(deadline)
            if not error:
                atexit.register(self.stop)
                return self
            self._terminate()
            if time.monotonic() >= deadline:
                break
        raise RuntimeError(f"{self.name} did not start: {error}")

    def stop(self) -> None:
        """Terminate the server, wait for it and remove its state; idempotent."""
        atexit.unregister(self.stop)
        self._terminate()
        shutil.rmtree(self.state, ignore_errors=True)

    def _wait_ready(self, deadline: float) -> str:
        """ "" once the server answers an HTTP request, else why not."""
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return f"exited with {self._proc.returncode}: {self.log_tail()}"
            conn = http.client.HTTPConnection(HOST, self.port, timeout=2.0)
            try:
                conn.request("GET", "/")  # any answer means it serves
                conn.getresponse().read()
                return ""
            except OSError:
                time.sleep(0.05)  # polling a port that is not open yet
            finally:
                conn.close()
        return f"not answering after {self._start_timeout:.0f}s: {self.log_tail()}"

    @property
    def _log(self) -> Path:
        return self.state / f"{self.name}.log"

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines of the server's output, joined by " | "."""
        with contextlib.suppress(OSError):
            return " | ".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def _terminate(self) -> None:
        proc, self._proc, self._port = self._proc, None, None
        if proc is None or proc.poll() is not None:
            return
        if self.graceful:
            proc.terminate()
        else:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
