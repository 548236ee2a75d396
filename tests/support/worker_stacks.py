"""Where a stuck DataLoader worker of a test job is: its threads' Python and native stacks,
printed on stderr when the DataLoader's timeout fires (the timeout says a worker is stuck,
not where). Used by the jobs in tests/support (not a test module)."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def stacks_on_sigusr2(_worker_id: int | None = None) -> None:
    """This process prints every thread's Python stack on SIGUSR2 (see dump_worker_stacks).
    Called in the rank before its DataLoader forks (the handler is inherited: a worker stuck
    before its ``worker_init_fn`` answers too), and as the ``worker_init_fn`` (a worker
    started by a forkserver inherits nothing from the rank)."""
    faulthandler.register(signal.SIGUSR2, all_threads=True)


def _native_stacks(pid: int) -> str:
    """Where each thread of ``pid`` waits in the kernel, and its C stacks when gdb is here."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with contextlib.suppress(OSError):
            comm = (task / "comm").read_text().strip()
            wchan = (task / "wchan").read_text().strip()
            syscall = (task / "syscall").read_text().strip()
            lines.append(f"task {task.name} {comm}: wchan={wchan} syscall={syscall}")
    gdb = shutil.which("gdb")
    if gdb is not None:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            done = subprocess.run(
                [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            lines.append(done.stdout[-12000:])
    return "\n".join(lines)


def dump_worker_stacks() -> None:
    """Ask every DataLoader worker of this rank for its threads' stacks (on stderr): the
    DataLoader's timeout says a worker is stuck, not where."""
    workers = multiprocessing.active_children()
    for worker in workers:
        print(f"=== worker {worker.pid}: native stacks ===", file=sys.stderr, flush=True)
        print(_native_stacks(worker.pid), file=sys.stderr, flush=True)
    for worker in workers:
        print(f"=== worker {worker.pid}: Python stacks ===", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            os.kill(worker.pid, signal.SIGUSR2)
        worker.join(1.0)  # a bounded pause for the dump (the worker does not exit)


def watched(loader: Iterable[Any]) -> Iterator[Any]:
    """``loader``'s batches; on the DataLoader's timeout, the workers' stacks first."""
    try:
        yield from loader
    except RuntimeError as exc:
        if "timed out" in str(exc):
            dump_worker_stacks()
        raise
