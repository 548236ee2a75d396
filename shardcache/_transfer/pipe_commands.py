"""Running a ``pipe:`` URL's command: its standard output is the shard, as in webdataset.

``pipe:aws s3 cp s3://b/x.tar -`` runs ``aws s3 cp s3://b/x.tar -`` with ``/bin/sh -c`` (as
webdataset's ``shell=True``) and streams its standard output into the cache's temp file.
One run of a command (:func:`run_command`):

- the command gets its own session and process group (so no terminal: a command that
  would prompt fails instead of hanging), standard input ``/dev/null``, and standard
  output and error through pipes;
- each chunk of standard output is handed to ``write`` and reported to ``on_bytes`` (the
  lock heartbeat and the prefetch watchdog see the bytes move); while the command is
  silent ``on_bytes`` is still called every ``TICK`` seconds with the same count, so a
  cancellation raised from it (the prefetcher's) takes effect at once;
- standard error is read as it comes (a chatty command never blocks on a full pipe) and
  only its last ``STDERR_TAIL`` bytes are kept, for the error message;
- the run succeeds when standard output reached its end and the shell exited with status
  0. A nonzero status, death by a signal, or no byte on standard output for
  ``io_timeout`` seconds (the group is then killed) raise :class:`CommandFailed`;
- however it ends (success, failure, a write error, a cancellation, any exception), the
  whole process group is killed with SIGKILL before the shell is reaped, so nothing the
  command started in its group outlives the run. The group is killed while the shell is
  still unreaped, so its id cannot have been reused by then.

Unlike webdataset, which ignores status 141 (SIGPIPE) because its reader may stop before
the end of the stream, every byte is read here: any nonzero status is a failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from .._base.errors import UrlError
from .._base.redact import get_logger
from .._base.url_kinds import PIPE_PREFIX
from .._config.borrowed import webdataset_secure

logger = get_logger(__name__)

SHELL = "/bin/sh"
STDERR_TAIL = 4096
"""Bytes of a command's standard error kept for the error message (the last ones)."""
TICK = 0.2
"""Seconds between progress calls while a command writes nothing."""
_PIPE_SIZE = 1 << 20  # a larger pipe buffer: fewer reads and progress calls per byte
_REAP_TIMEOUT = 10.0  # a SIGKILLed process in uninterruptible sleep may take a moment


class CommandFailed(Exception):
    """One run of a command failed (internal: :class:`~shardcache._transfer.remote.Remote` retries
    it and raises :class:`~shardcache.PipeCommandError` in the end)."""

    def __init__(
        self, command: str, exit_status: int | None, stderr: str, timed_out: bool, size: int
    ) -> None:
        self.command = command
        self.exit_status = exit_status
        self.stderr = stderr
        self.timed_out = timed_out
        self.size = size  # bytes of standard output received before it failed
        super().__init__(self.describe())

    def describe(self, io_timeout: float | None = None) -> str:
        """What happened, in words: the status (or signal, or timeout) and the stderr tail."""
        if self.timed_out:
            after = f" for {io_timeout:g}s" if io_timeout is not None else ""
            what = (
                f"wrote nothing to its standard output{after} (SHARDCACHE_IO_TIMEOUT) after "
                f"{self.size} bytes and was killed with its process group"
            )
        else:
            what = f"{describe_status(self.exit_status)} after writing {self.size} bytes"
        tail = " ".join(self.stderr.split())
        return f"{what}; stderr: {tail!r}" if tail else f"{what}; no stderr output"


def describe_status(status: int | None) -> str:
    """``Popen.returncode`` in words: "exited with status 3", "was killed by signal SIGSEGV"."""
    if status is None:
        return "did not exit"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = str(-status)
        return f"was killed by signal {name}"
    return f"exited with status {status}"


def command_of(url: str) -> str:
    """The shell command of a ``pipe:`` URL."""
    return url[len(PIPE_PREFIX) :]


def check_allowed(url: str) -> None:
    """Refuse ``pipe:`` URLs where webdataset does (``WDS_SECURE=1``, its enforce_security)."""
    wds_utils = sys.modules.get("webdataset.utils")
    if wds_utils is not None:
        secure = bool(getattr(wds_utils, "enforce_security", False))
    else:
        secure = webdataset_secure()
    if secure:
        raise UrlError(
            f"pipe: URLs run shell commands and are disabled by webdataset's security setting "
            f"(WDS_SECURE=1 / webdataset.utils.enforce_security): {url[:200]!r}. Use a URL "
            "the cache can read itself (s3://, https://, a path), or unset WDS_SECURE if the "
            "commands are trusted.",
            spec=url[:200],
            expected="a URL that runs no command (pipe: is disabled)",
            seen="a pipe: URL",
            hint="unset WDS_SECURE, or use an s3:// / https:// / local URL",
        )


def run_command(
    command: str,
    write: Callable[[bytes], object],
    on_bytes: Callable[[int], None],
    *,
    io_timeout: float,
    chunk_size: int = 8 << 20,
) -> int:
    """Run ``command`` once (see the module docstring); returns the bytes it wrote to its
    standard output, all of which went to ``write``. Raises :class:`CommandFailed`, or
    whatever ``write`` / ``on_bytes`` raise (the process group is killed first)."""
    run = _Run(command)
    try:
        run.pump(write, on_bytes, io_timeout, chunk_size)
    finally:
        run.close()
    if run.proc.returncode != 0:
        raise run.failed(timed_out=False)
    return run.size


class _Run:
    """One running command: its pipes, its exit notification and what it wrote so far."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.proc = subprocess.Popen(
            [SHELL, "-c", command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own session and process group, no terminal
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out_fd, self.err_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.out_fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        self.exit_fd = _pidfd(self.proc.pid)
        self.sel = selectors.DefaultSelector()
        for fd in (self.out_fd, self.err_fd, self.exit_fd):
            if fd is not None:
                os.set_blocking(fd, False)
                self.sel.register(fd, selectors.EVENT_READ)
        self.size = 0
        self.stderr = bytearray()
        self.exited = False

    def pump(
        self,
        write: Callable[[bytes], object],
        on_bytes: Callable[[int], None],
        io_timeout: float,
        chunk_size: int,
    ) -> None:
        """Move standard output to ``write`` until it ends and the shell has exited."""
        on_bytes(0)
        last_byte = last_report = time.monotonic()
        while self._open(self.out_fd) or not self.exited:
            now = time.monotonic()
            if now - last_byte >= io_timeout:
                self.close()
                raise self.failed(timed_out=True)
            if now - last_report >= TICK:
                on_bytes(self.size)  # the count is unchanged, but a cancellation gets in
                last_report = now
            wait = max(0.0, min(TICK, io_timeout - (now - last_byte)))
            for key, _ in self.sel.select(wait):
                if key.fd == self.out_fd:
                    data = self._take(self.out_fd, chunk_size)
                    if data is None:
                        continue
                    last_byte = last_report = time.monotonic()  # the exit must follow in time
                    if data:
                        write(data)
                        self.size += len(data)
                        on_bytes(self.size)
                elif key.fd == self.err_fd:
                    self._take_stderr()
                else:
                    self._take(key.fd, 0)
                    self.exited = True
            if self.exit_fd is None and not self.exited:
                self.exited = _exited_unreaped(self.proc.pid)
        # What the command wrote last: the pipe may still hold up to its capacity (64 KiB
        # or more) behind the kept tail, so it is read to its end (or until nothing is
        # there), bounded in time: a leftover child may go on writing.
        deadline = time.monotonic() + TICK
        while self._take_stderr() and time.monotonic() < deadline:
            pass

    def _open(self, fd: int) -> bool:
        return fd in self.sel.get_map()

    def _take(self, fd: int, n: int) -> bytes | None:
        """Up to ``n`` bytes of ``fd`` (unregistered at its end, or for the exit
        descriptor); None when nothing was there after all."""
        if fd == self.exit_fd:
            self.sel.unregister(fd)
            return b""
        try:
            data = os.read(fd, n)
        except BlockingIOError:
            return None
        if not data:
            self.sel.unregister(fd)
        return data

    def _take_stderr(self) -> bool:
        """Read what standard error holds into the kept tail; False when nothing came."""
        if not self._open(self.err_fd):
            return False
        data = self._take(self.err_fd, STDERR_TAIL)
        if not data:
            return False
        self.stderr += data
        del self.stderr[:-STDERR_TAIL]
        return True

    def failed(self, *, timed_out: bool) -> CommandFailed:
        text = bytes(self.stderr).decode("utf-8", "replace")
        return CommandFailed(self.command, self.proc.returncode, text, timed_out, self.size)

    def close(self) -> None:
        """Kill the process group, reap the shell, close the pipes (idempotent)."""
        _kill_group(self.proc)
        self.sel.close()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (without reaping it)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3: poll with waitid instead
        return None


def _exited_unreaped(pid: int) -> bool:
    try:
        result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return result is not None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the command's whole process group, then reap the shell (idempotent)."""
    if proc.returncode is not None:
        return
    # The shell is not reaped yet (a zombie at worst), so its pid, which is the group's id,
    # cannot belong to anyone else.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError as exc:  # a member changed its credentials (setuid): not ours
        logger.warning("cannot kill the process group of %r: %s", proc.args, exc)
    try:
        proc.wait(timeout=_REAP_TIMEOUT)
    except subprocess.TimeoutExpired:
        logger.warning(
            "pid %d (%r) did not exit within %.0fs of SIGKILL (uninterruptible I/O?)",
            proc.pid,
            proc.args,
            _REAP_TIMEOUT,
        )


__all__ = [
    "SHELL",
    "STDERR_TAIL",
    "TICK",
    "CommandFailed",
    "check_allowed",
    "command_of",
    "describe_status",
    "run_command",
]
