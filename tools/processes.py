"""Worker functions raced in spawned processes: their start and clean-up, shared by the tests
(tests/support/processes.py) and the benchmarks (bench/support/processes.py), which each
collect the results in their own way."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

CTX = mp.get_context("spawn")


@contextlib.contextmanager
def started_together(
    target: Callable[..., None], arg_lists: Sequence[tuple[Any, ...]]
) -> Iterator[tuple[list[BaseProcess], Any]]:
    """Start one process per argument tuple; each gets ``(*args, start, out)``, must wait on
    the ``start`` barrier (so they really race) and put its result on the queue ``out``.
    Yields ``(processes, out)``. On leaving, the barrier is aborted (no process waits at it
    for one that is gone) and every process still alive is killed."""
    start, out = CTX.Barrier(len(arg_lists)), CTX.Queue()
    procs = [CTX.Process(target=target, args=(*args, start, out)) for args in arg_lists]
    for p in procs:
        p.start()
    try:
        yield procs, out
    finally:
        start.abort()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
