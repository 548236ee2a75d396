"""Worker functions raced in spawned processes: the benchmarks' own, bounded, pytest-free."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import Any

from bench.support.infra import CTX

RESULT_TIMEOUT = 600  # seconds the slowest process's result may take (a bound for a hang only)


def run_together(target: Callable[..., None], arg_lists: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Start one process per argument tuple; each gets ``(*args, start, out)``, waits on the
    ``start`` barrier (so they really race) and puts one result on ``out``. Returns the
    results in completion order; raises ``RuntimeError`` when a result does not come within
    ``RESULT_TIMEOUT`` seconds or a process exits with an error."""
    start, out = CTX.Barrier(len(arg_lists)), CTX.Queue()
    procs = [CTX.Process(target=target, args=(*args, start, out)) for args in arg_lists]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=RESULT_TIMEOUT) for _ in procs]
        for p in procs:
            p.join(60)
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(
            f"a result of {target.__name__} never came (exit codes {codes})"
        ) from None
    finally:
        start.abort()  # no process waits at the barrier for one that is gone
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if codes := [p.exitcode for p in procs if p.exitcode != 0]:
        raise RuntimeError(
            f"{target.__name__} failed in {len(codes)} process(es): exit codes {codes}"
        )
    return results
