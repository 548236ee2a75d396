"""The loader report of an epoch: :func:`log_epoch_summary` closes the epoch in this
process's collector (``metrics``) and returns the rank's report, and, when
``torch.distributed`` is initialised, gathers every rank's on rank 0 and logs the job's
line. What a report holds and how it is summed and written: ``_observe.summary``.
"""

from __future__ import annotations

import sys
from typing import Any

from .._base.redact import get_logger
from . import metrics
from .summary import WORST_RANKS, format_job_line, merge

logger = get_logger(__name__)


def log_epoch_summary(epoch: int | None = None) -> dict[str, Any]:
    """Close epoch ``epoch`` in this (training) process, log this rank's line, and
    return its report. When ``torch.distributed`` is initialised this is a collective
    (every rank must call it): the ranks' reports are gathered, rank 0 logs one line
    for the job (totals and the ranks that waited most for data) and returns the job's
    report (other ranks return their own).

    Call it after each epoch's loop. If the stage already closed this epoch here (it
    was iterated to exhaustion in this process), that report is used as it is.
    """
    made = metrics.collector()
    last = made.last_rank_report
    if last is not None and (epoch is None or last.get("epoch") == epoch):
        report = last
    else:
        report = made.end_epoch(epoch)
    made.last_rank_report = None
    dist = _initialised_dist()
    if dist is None:
        return report
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() != 0:
        return report
    reports = [r for r in gathered if r is not None]
    logger.info(format_job_line(reports))
    job = merge(reports)
    job["worst_ranks"] = [
        {"rank": r.get("rank"), "data_wait_share": r["data_wait_share"]}
        for r in sorted(reports, key=lambda r: -r["data_wait_share"])[:WORST_RANKS]
    ]
    return job


def _initialised_dist() -> Any:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except (AttributeError, RuntimeError):
        return None
    return None
