"""Worker functions raced in spawned processes, their results awaited for a bounded time
(tools/processes.py starts them and cleans up)."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from typing import Any

from tools.processes import started_together

RESULT_TIMEOUT = 600  # seconds the slowest process's result may take (a bound for a hang only)


def run_together(target: Callable[..., None], arg_lists: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Start one process per argument tuple; each gets ``(*args, start, out)``, waits on the
    ``start`` barrier (so they really race) and puts one result on ``out``. Returns the
    results in completion order; raises ``RuntimeError`` when a result does not come within
    ``RESULT_TIMEOUT`` seconds or a process exits with an error."""
    with started_together(target, arg_lists) as (procs, out):
        try:
            results = [out.get(timeout=RESULT_TIMEOUT) for _ in procs]
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            raise RuntimeError(
                f"a result of {target.__name__} never came (exit codes {codes})"
            ) from None
        for p in procs:
            p.join(60)
    if codes := [p.exitcode for p in procs if p.exitcode != 0]:
        raise RuntimeError(
            f"{target.__name__} failed in {len(codes)} process(es): exit codes {codes}"
        )
    return results
