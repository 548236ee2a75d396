"""Prometheus export of "shardcache.metrics" records (the ``prometheus`` extra).

:class:`PrometheusSink` is a plain callable ``sink(record)``: register it with
``shardcache.add_metrics_sink(sink)`` and it keeps counters and gauges in its own
``CollectorRegistry`` (never the global one: two sinks, or the user's own metrics, do not
collide), served over HTTP and/or written to a node_exporter textfile.

Names follow ``shardcache_<what>_<unit>_total``. Labels are ``job_id``, ``host``, ``rank``
and ``worker`` (``main`` or the DataLoader worker id), plus ``result`` / ``method`` /
``cause`` from fixed sets (``method``: a request's, or how a shard was verified) and, on the
``shardcache_source_*`` counters, ``source`` (a ``MixtureDataset``'s source names, which the
user chose): never a URL or any other unbounded value. (``job_id``, not ``job``: Prometheus
sets ``job`` itself on every scrape.)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._base.extras import require_extras
from .._base.redact import get_logger
from . import metric_records as mr

log = get_logger(__name__)

LABELS = ("job_id", "host", "rank", "worker")
METHODS = frozenset({"GET", "HEAD", "LIST", "PUT", "POST", "DELETE"})
CAUSES = frozenset(mr.RETRY_CAUSES)

# counter name (without _total) -> (record field, help)
_COUNTERS = {
    "samples": ("samples", "Samples delivered to the consumer."),
    "shards": ("shards", "Shards delivered to the consumer."),
    "downloaded_bytes": ("bytes_downloaded", "Bytes downloaded from the store."),
    "served_bytes": ("bytes_served", "Bytes served to readers (cache hits and downloads)."),
    "peer_bytes": ("bytes_from_peers", "Bytes filled from peers of the cache mesh."),
    "peer_fallbacks": ("peer_fallbacks", "Peers of the cache mesh that failed a fill."),
    "peer_corruptions": ("peer_corruptions", "Peers' copies that failed their checksum."),
    "integrity_redownloads": (
        "integrity_redownloads",
        "Shards downloaded again after failing verification.",
    ),
    "data_wait_seconds": ("data_wait_s", "Time the consumer waited for data."),
    "stall_warnings": ("stall_warnings", "Warnings that loading cannot keep up."),
    "stall_errors": ("stall_errors", "StallErrors raised."),
    "delivery_checks": (
        "delivery_checks",
        "Checks of the samples delivered against the resumable dataset's plan.",
    ),
    "delivery_mismatches": (
        "delivery_mismatches",
        "Delivery checks that found samples skipped or repeated.",
    ),
}


def _prometheus_client() -> Any:
    require_extras("shardcache.PrometheusSink", "prometheus")
    import prometheus_client

    return prometheus_client


class PrometheusSink:
    """Keeps Prometheus metrics from the records it is fed; serves and/or writes them.

    >>> sink = shardcache.PrometheusSink(port=9464)            # http://127.0.0.1:9464/metrics
    >>> shardcache.add_metrics_sink(sink)
    >>> sink = shardcache.PrometheusSink(textfile="/var/lib/node_exporter/shardcache.prom")

    ``port``: serve ``/metrics`` over HTTP on ``addr`` (127.0.0.1 unless you open it up
    on purpose); ``0`` picks a free port (``sink.port`` says which). ``textfile``: after
    every record, atomically replace this file (a temp file in its directory renamed over
    it) for node_exporter's textfile collector, whose name should end in ``.prom``.
    Neither: the metrics are only kept in ``sink.registry``, for you to expose.

    Counters (per ``job_id``, ``host``, ``rank``, ``worker``): ``shardcache_samples_total``,
    ``shardcache_shards_total``, ``shardcache_fetches_total{result=hit|miss|shared|peer}``,
    ``shardcache_downloaded_bytes_total``, ``shardcache_served_bytes_total``,
    ``shardcache_peer_bytes_total``, ``shardcache_peer_fallbacks_total``,
    ``shardcache_peer_corruptions_total`` (the cache mesh's fills, failed peers, damaged copies),
    ``shardcache_requests_total{method}``, ``shardcache_retries_total{cause}``,
    ``shardcache_shards_verified_total{method}`` (shards downloaded, by verification:
    ``crc64nvme``, ``md5``, ``md5-parts``, ..., ``size``),
    ``shardcache_integrity_redownloads_total``, ``shardcache_lock_waits_total``,
    ``shardcache_lock_wait_seconds_total``, ``shardcache_data_wait_seconds_total``,
    ``shardcache_recorded_seconds_total`` (time covered by records carrying a data wait:
    ``rate(data_wait) / rate(recorded)`` is the share over any window),
    ``shardcache_stall_warnings_total``, ``shardcache_stall_errors_total``,
    ``shardcache_delivery_checks_total``, ``shardcache_delivery_mismatches_total`` (checks
    of what a resumable dataset delivered against its plan, and those that failed). Gauges, from
    the latest record: ``shardcache_data_wait_share`` (0..1),
    ``shardcache_samples_per_second``, ``shardcache_last_record_timestamp_seconds``.

    Only the process that made the sink acts on records: in a forked DataLoader worker the
    endpoint is not served and the file would be a second writer's, so records there are
    ignored (workers' records that shardcache passes to the main process are counted).
    Records of another schema are ignored; of a newer schema version, logged once and
    ignored. :meth:`close` stops the server and writes the file a last time.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        addr: str = "127.0.0.1",
        textfile: str | os.PathLike[str] | None = None,
    ) -> None:
        client = _prometheus_client()
        self._client = client
        self.registry = client.CollectorRegistry(auto_describe=True)
        self.textfile = Path(textfile) if textfile is not None else None
        self._owner = mr.OwnerProcess()
        self._clock = mr.PeriodClock()
        self._warned_newer = False
        self._counters = {
            name: client.Counter(f"shardcache_{name}", text, LABELS, registry=self.registry)
            for name, (_field, text) in _COUNTERS.items()
        }

        def counter(name: str, text: str, *extra: str) -> Any:
            return client.Counter(
                f"shardcache_{name}", text, (*LABELS, *extra), registry=self.registry
            )

        def gauge(name: str, text: str) -> Any:
            return client.Gauge(f"shardcache_{name}", text, LABELS, registry=self.registry)

        self._fetches = counter("fetches", "Shards fetched, by result.", "result")
        self._source_samples = counter(
            "source_samples", "Samples delivered, per mixture source.", "source"
        )
        self._source_fetches = counter(
            "source_fetches", "Shards fetched, per mixture source and result.", "source", "result"
        )
        self._source_downloaded = counter(
            "source_downloaded_bytes", "Bytes downloaded, per mixture source.", "source"
        )
        self._requests = counter("requests", "Requests sent to the store.", "method")
        self._verified = counter(
            "shards_verified",
            "Shards downloaded, by how they were verified (a checksum; size: the size only).",
            "method",
        )
        self._retries = counter("retries", "Retried requests, by cause.", "cause")
        self._lock_waits = counter("lock_waits", "Waits for a shard lock held elsewhere.")
        self._lock_wait_s = counter("lock_wait_seconds", "Time spent waiting for shard locks.")
        self._recorded = counter(
            "recorded_seconds", "Time covered by records that carry a data wait."
        )
        self._share = gauge("data_wait_share", "Data-wait share of the latest period (0..1).")
        self._rate = gauge("samples_per_second", "Samples per second in the latest period.")
        self._last = gauge("last_record_timestamp_seconds", "Unix time of the latest record.")
        self._server: Any = None
        self._thread: Any = None
        self.port: int | None = None
        if port is not None:
            self._server, self._thread = client.start_http_server(
                port, addr=addr, registry=self.registry
            )
            self.port = int(self._server.server_port)
        self._addr = addr
        if self.textfile is not None:
            self.write_textfile()

    @property
    def url(self) -> str | None:
        """``http://ADDR:PORT/metrics`` when serving, else None."""
        if self.port is None:
            return None
        host = f"[{self._addr}]" if ":" in self._addr else self._addr
        return f"http://{host}:{self.port}/metrics"

    def __call__(self, record: Mapping[str, Any]) -> None:
        if not self._owner.here():
            return
        verdict = mr.classify(record)
        if verdict == mr.NEWER and not self._warned_newer:
            self._warned_newer = True
            log.warning(
                "PrometheusSink: ignoring shardcache.metrics records of version %s "
                "(this shardcache reads version %s)",
                record.get("version"),
                mr.VERSION,
            )
        if verdict != mr.OK:
            return
        with self._owner.lock:
            self._count(record)
            if self.textfile is not None:
                self._write_textfile()

    def _count(self, record: Mapping[str, Any]) -> None:
        worker = record.get("worker")
        labels = {
            "job_id": _text(record.get("job_id")),
            "host": _text(record.get("host")),
            "rank": _text(record.get("rank")),
            "worker": "main" if worker is None else _text(worker),
        }
        for name, (field, _help) in _COUNTERS.items():
            _inc(self._counters[name].labels(**labels), mr.number(record, field))
        for result, field in mr.FETCH_RESULTS:
            _inc(self._fetches.labels(**labels, result=result), mr.number(record, field))
        for source, part in mr.sources(record).items():
            _inc(self._source_samples.labels(**labels, source=source), part["samples"])
            _inc(self._source_downloaded.labels(**labels, source=source), part["bytes_downloaded"])
            for result, field in mr.FETCH_RESULTS:
                fetches = self._source_fetches.labels(**labels, source=source, result=result)
                _inc(fetches, part[field])
        for sent, n in mr.counts(record, "requests").items():
            method = sent.upper() if sent.upper() in METHODS else "other"
            _inc(self._requests.labels(**labels, method=method), n)
        for method, n in mr.counts(record, "verified").items():
            _inc(self._verified.labels(**labels, method=mr.verified_label(method)), n)
        for cause, n in mr.counts(record, "retries").items():
            _inc(self._retries.labels(**labels, cause=cause if cause in CAUSES else "other"), n)
        waits = record.get("lock_waits")
        if isinstance(waits, dict):
            _inc(self._lock_waits.labels(**labels), mr.number(waits, "count"))
            _inc(self._lock_wait_s.labels(**labels), mr.number(waits, "seconds"))
        begin, end = self._clock.covered(record)
        covered = end - begin
        wait = mr.optional_number(record, "data_wait_s")
        if wait is not None:
            _inc(self._recorded.labels(**labels), covered)
            if covered > 0:
                self._share.labels(**labels).set(min(1.0, wait / covered))
        if covered > 0:
            self._rate.labels(**labels).set(mr.number(record, "samples") / covered)
        self._last.labels(**labels).set(end)

    def write_textfile(self) -> None:
        """Replace the textfile with the current metrics now (atomically)."""
        if self.textfile is None:
            raise ValueError("this PrometheusSink has no textfile")
        with self._owner.lock:
            self._write_textfile()

    def _write_textfile(self) -> None:
        assert self.textfile is not None
        data = self._client.generate_latest(self.registry)
        # A temp file in the same directory renamed over the target: node_exporter reads
        # either the old file or the new one, never half of one. Its name does not end in
        # .prom, so the collector never reads it.
        fd, tmp = tempfile.mkstemp(prefix=f".{self.textfile.name}.", dir=self.textfile.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)  # node_exporter usually runs as another user
            os.replace(tmp, self.textfile)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def close(self) -> None:
        """Stop serving (if serving) and write the textfile a last time (if any)."""
        if self._server is not None and self._owner.here():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None
        if self.textfile is not None and self._owner.here():
            self.write_textfile()

    def __enter__(self) -> PrometheusSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = [w for w in (self.url, self.textfile and str(self.textfile)) if w]
        return f"PrometheusSink({', '.join(where) or 'registry only'})"


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _inc(child: Any, amount: float) -> None:
    if amount > 0:
        child.inc(amount)


__all__ = ["PrometheusSink"]
