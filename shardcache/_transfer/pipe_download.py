"""The download of a ``pipe:`` URL: its command's standard output (run by
:mod:`shardcache._transfer.pipe_commands`).

The size is unknown until the command ends (``ObjectInfo.size`` is None until the
download returns the info with the size it saw). A run is verified by its exit status (0)
and the byte count; any failed run (nonzero status, a signal, no output for
``io_timeout``) is retried under the retry policy, each run from byte 0 (a command cannot
be resumed), because a status does not say whether the cause was transient; the last
failure is raised as :class:`PipeCommandError`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import BinaryIO

from .._base.errors import PipeCommandError
from .._base.redact import get_logger
from .._observe import metrics
from .._retry.policy import retry_cause
from .download import ObjectInfo, OpenedObject, Progress, Strategy, local_io, restart
from .pipe_commands import CommandFailed, command_of, run_command

logger = get_logger(__name__)


class PipeDownload(Strategy):
    """A ``pipe:`` command's output, run until one run exits 0."""

    def download(
        self,
        info: ObjectInfo,
        out: BinaryIO,
        progress: Progress,
        opened: OpenedObject | None = None,  # never: a command is run, not requested
    ) -> ObjectInfo:
        command = command_of(info.url)
        self.expectation(info)  # SHARDCACHE_VERIFY=strict refuses what only a size checks

        def write(data: bytes) -> None:
            with local_io():
                out.write(data)

        def attempt(n: int) -> ObjectInfo:
            def moved(done: int) -> None:
                progress(phase=self.phase(n, "running command"), bytes_done=done, bytes_total=None)

            restart(out)
            size = run_command(
                command,
                write,
                moved,
                io_timeout=self.options.io_timeout,
                chunk_size=self.options.chunk_size,
            )
            return replace(info, size=size)

        def give_up(exc: Exception, n: int) -> BaseException:
            if not isinstance(exc, CommandFailed):
                return exc
            return self._error(info.url, n, exc)

        def on_retry(exc: Exception, n: int) -> None:
            assert isinstance(exc, CommandFailed)
            what = exc.describe(self.options.io_timeout)
            metrics.retried(retry_cause(exc))
            logger.info("retrying pipe command %r (attempt %d): it %s", command, n, what)

        return self.options.retry.run(
            attempt,
            retry_if=lambda exc: isinstance(exc, CommandFailed),
            give_up=give_up,
            on_retry=on_retry,
        )

    def _error(self, url: str, attempts: int, failure: CommandFailed) -> PipeCommandError:
        what = failure.describe(self.options.io_timeout)
        return PipeCommandError(
            f"pipe command {failure.command!r} {what}. An exit status does not say whether a "
            f"failure is transient, so every failure is retried: it failed on all {attempts} "
            f"attempt(s) (SHARDCACHE_RETRIES={attempts - 1}) and nothing was cached. Run the "
            "command in a shell to see why (it must write the shard to its standard output "
            "and exit with status 0).",
            url=url,
            attempts=attempts,
            cause=what,
            command=failure.command,
            exit_status=failure.exit_status,
            stderr=failure.stderr,
            timed_out=failure.timed_out,
        )
