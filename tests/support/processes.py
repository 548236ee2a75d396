"""Run worker functions in real (spawned) processes and collect what they report."""

from __future__ import annotations

import gc
import os
import queue
import sys
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import pytest

# The timeout of a test whose spawned processes start together (each importing shardcache,
# some torch): a bound for a hang only. Beside other tests' load (load average 20 on 2
# cores) such a test took up to 190 s where it takes 10-25 s on an idle machine.
TOGETHER_TIMEOUT = 400
# A test job's process-group timeout (its rendezvous and every collective): the longest one
# rank may wait for another. A rank of a 2-rank DDP job fell 30 s behind the other at load 10
# on 2 cores; a job whose ranks disagree (one short of a batch) still fails by itself, after
# this. A test that checks that failure passes its own short timeout.
COLLECTIVE_TIMEOUT = 120
# A test's bound on a torchrun job that ends by itself: a job stuck at a collective has
# failed after COLLECTIVE_TIMEOUT; this catches any other hang, with room for a slow machine.
JOB_TIMEOUT = COLLECTIVE_TIMEOUT + 180


def run_together(target: Callable[..., None], arg_lists: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Start one process per argument tuple; each gets ``(*args, start, out)``, must wait on
    the ``start`` barrier (so they really race; with no time bound: how long the others take
    to start depends on the machine's load) and put one result on ``out``. Returns the
    results (in completion order) after checking every process exited cleanly."""
    # Imported here: the jobs tests launch import this module from tests/support alone,
    # without the repository's root (and so ``tools``) on their path.
    from tools.processes import started_together

    with started_together(target, arg_lists) as (procs, out):
        results = collect(out, procs, len(procs))
        for p in procs:  # ending (a process group's teardown) can take a while under load
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"exit codes {codes}"
    return results


def collect(out: Any, procs: Sequence[BaseProcess], count: int) -> list[Any]:
    """``count`` results from the queue ``out``, awaited as long as ``procs`` run: no fixed
    bound that a slower machine could exceed (the test's timeout catches a hang). Fails,
    naming the exit codes, once a process ended with an error, or all ended, short of
    ``count`` (after taking what they put before ending)."""
    results: list[Any] = []
    ended = False
    while len(results) < count:
        try:
            results.append(out.get(timeout=1))
            continue
        except queue.Empty:
            if ended:
                codes = [p.exitcode for p in procs]
                pytest.fail(
                    f"{count - len(results)} of {count} results never came: a process failed "
                    f"or all ended (exit codes {codes}; their errors are in the captured stderr)"
                )
        codes = [p.exitcode for p in procs]
        ended = None not in codes or any(code not in (None, 0) for code in codes)
    return results


def wait_set(event: Any, procs: Sequence[BaseProcess], what: str) -> None:
    """Wait for ``event``, set by one of ``procs``, as long as they all run (the test's
    timeout catches a hang); fails naming ``what`` once one ended first."""
    while not event.wait(1):
        codes = [p.exitcode for p in procs]
        if any(code is not None for code in codes) and not event.is_set():
            pytest.fail(f"{what} never happened: a process ended first (exit codes {codes})")


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a job the tests launch: this one without SHARDCACHE_* settings
    (the job sets its own), one OpenMP thread per process, plus ``extra``."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("SHARDCACHE_")},
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def torchrun(ranks: int, job: str | os.PathLike[str], *args: str) -> list[str]:
    """The command line that runs ``job`` under torchrun with ``ranks`` local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        os.fspath(job),
        *args,
    ]


def exit_at_once(code: int) -> NoReturn:
    """End a job's rank with ``code`` once its work, files and process group are done,
    without the interpreter's finalisation: even after :func:`end_process_group`, a rank
    still aborted in it under load (SIGABRT while garbage-collecting torch's objects at
    exit, 1 run in 5 of the mixture job beside other tests), which is torch's teardown
    (pytorch#190489), not the job's outcome. Every file the job writes is closed or
    flushed before; the jobs use no metrics files, whose close records exit would write."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_process_group() -> None:
    """Destroy the default process group while the interpreter is whole; a job calls it
    last, after dropping the group's other owners (a DDP model).

    The group must really go, not only leave torch's registry: a gloo worker
    thread may still be freeing the tensors of the last ``all_gather_object`` (the epoch
    report's), which takes the GIL; if the group outlives ``main`` that happens during
    interpreter finalisation and aborts the rank ("terminate called without an active
    exception", SIGABRT, after the job's work is done). The group's destructor drains its
    queue and joins those threads."""
    import torch.distributed as dist

    gc.collect()  # DDP's hooks form reference cycles
    dist.destroy_process_group()
