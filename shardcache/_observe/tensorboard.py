"""TensorBoard scalars from "shardcache.metrics" records, through the user's SummaryWriter.

shardcache imports nothing of TensorBoard here: the sink only calls
``writer.add_scalar(tag, value, global_step, walltime)``, which
``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package: the
``tensorboard`` extra) and tensorboardX's writer both have.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from . import metric_records as mr

# scalar name -> record field, written as the per-record delta
_DELTAS = {
    "hits": "hits",
    "misses": "misses",
    "shared": "shared",
    "from_peers": "from_peers",
    "bytes_downloaded": "bytes_downloaded",
    "bytes_served": "bytes_served",
    "integrity_redownloads": "integrity_redownloads",
    "stall_warnings": "stall_warnings",
    "stall_errors": "stall_errors",
    "delivery_mismatches": "delivery_mismatches",
}


class TensorBoardSink:
    """Writes each record's numbers as TensorBoard scalars.

    >>> from torch.utils.tensorboard import SummaryWriter
    >>> writer = SummaryWriter("runs/exp1")
    >>> shardcache.add_metrics_sink(shardcache.TensorBoardSink(writer))

    Per record, under ``prefix`` (``shardcache/``; a DataLoader worker's records under
    ``shardcache/worker<N>/``): ``data_wait_share`` (0..1, when the record carries a data
    wait), ``samples_per_s``, ``download_bytes_per_s``, ``hit_rate`` (when shards were
    fetched), and the period's ``hits``, ``misses``, ``shared``, ``from_peers``,
    ``bytes_downloaded``, ``bytes_served``, ``gets``, ``retries`` (all causes),
    ``integrity_redownloads``, ``lock_wait_s``, ``stall_warnings``, ``stall_errors``,
    ``delivery_mismatches``, and ``verified_<method>`` (shards downloaded verified by
    ``method``: ``md5``, ``md5-parts``, ``size``, ...; for the methods a record counts).
    The walltime is the record's ``time``. The step is ``step()`` when given (e.g.
    ``lambda: trainer.global_step``, to line the scalars up with the training curves), else
    the record's index in its process's series (0, 1, 2, ...; TensorBoard's "wall" axis
    shows real time).

    Rates and the share use the time a record really covers (an epoch record's counts
    start at the process's previous record, not at the epoch start). Only the process that
    made the sink writes: a forked DataLoader worker's copy of the writer is ignored.
    """

    def __init__(
        self,
        writer: Any,
        *,
        prefix: str = "shardcache/",
        step: Callable[[], int] | None = None,
    ) -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(
                f"TensorBoardSink needs a writer with add_scalar (a "
                f"torch.utils.tensorboard.SummaryWriter), not {type(writer).__name__}"
            )
        self.writer = writer
        self.prefix = prefix
        self._step = step
        self._owner = mr.OwnerProcess()
        self._clock = mr.PeriodClock()
        self._counters: dict[Hashable, itertools.count[int]] = {}

    def __call__(self, record: Mapping[str, Any]) -> None:
        if not self._owner.here() or mr.classify(record) != mr.OK:
            return
        with self._owner.lock:
            begin, end = self._clock.covered(record)
            stream = mr.stream_of(record)
            if self._step is not None:
                step = int(self._step())
            else:
                step = next(self._counters.setdefault(stream, itertools.count()))
            worker = record.get("worker")
            tag = self.prefix if worker is None else f"{self.prefix}worker{worker}/"
            for name, value in self._scalars(record, end - begin).items():
                self.writer.add_scalar(f"{tag}{name}", value, global_step=step, walltime=end)

    @staticmethod
    def _scalars(record: Mapping[str, Any], covered: float) -> dict[str, float]:
        n = mr.number
        out = {name: n(record, field) for name, field in _DELTAS.items()}
        out["gets"] = mr.counts(record, "requests").get("GET", 0.0)
        out["retries"] = sum(mr.counts(record, "retries").values())
        for method, shards in mr.counts(record, "verified").items():
            label = f"verified_{mr.verified_label(method)}"
            out[label] = out.get(label, 0.0) + shards
        waits = record.get("lock_waits")
        out["lock_wait_s"] = n(waits, "seconds") if isinstance(waits, dict) else 0.0
        wait = mr.optional_number(record, "data_wait_s")
        if wait is not None and covered > 0:
            out["data_wait_share"] = min(1.0, wait / covered)
        if covered > 0:
            out["samples_per_s"] = n(record, "samples") / covered
            out["download_bytes_per_s"] = n(record, "bytes_downloaded") / covered
        fetched = sum(n(record, field) for _result, field in mr.FETCH_RESULTS)
        if fetched:
            out["hit_rate"] = n(record, "hits") / fetched
        return out


__all__ = ["TensorBoardSink"]
