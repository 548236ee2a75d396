"""``shardcache report DIR``: one table of a job's ranks from their metrics files.

Every ``*.jsonl`` under DIR (recursively) is read; each line should be a
"shardcache.metrics" record (see :mod:`shardcache._observe.metric_records`). Lines that are not
JSON (a process killed mid-line) or not such a record are skipped and counted; a record of
a newer schema version stops the report (its fields may mean something else).

Records are grouped by job id, then by rank. Counts are deltas per record, so a rank's
numbers are sums over its records, the main process's and its DataLoader workers' alike.
The data-wait share is the one exception: it is measured where the shardcache stage runs,
which is in the DataLoader workers when there are any (the main process then only
gathers, and its records carry no wait). A rank's share is sum(data_wait_s) / sum(covered
time) over its worker records (``worker`` set) when any of them carries ``data_wait_s``
(the workers' average share); otherwise over its main-process records; otherwise unknown.
Each rank says which (``data_wait_source``). Ranks are ordered worst first: highest data-wait
share, then most stall errors, stall warnings, retries.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._base.errors import MetricsError
from .._base.redact import redact_url
from .._observe import metric_records as mr

DEFAULT_TOP = 10
SHARDS_PER_RANK = 5  # slowest shards kept per rank (the schema's own bound per record)


@dataclass
class Segment:
    """What one record counted over the time it covers (the plot's input)."""

    rank: int | None
    begin: float
    end: float
    samples: float
    data_wait_s: float | None  # None: the record does not carry it
    main: bool
    epoch: int | None = None


@dataclass
class RankSummary:
    """Sums over one rank's records (all its processes)."""

    job_id: str | None
    rank: int | None
    hosts: set[str] = field(default_factory=set)
    processes: set[tuple[Any, Any]] = field(default_factory=set)  # (host, pid)
    workers: set[int] = field(default_factory=set)
    records: int = 0
    first: float = float("inf")
    last: float = float("-inf")
    samples: float = 0
    shards: float = 0
    hits: float = 0
    misses: float = 0
    shared: float = 0
    from_peers: float = 0  # the cache mesh's fills, and below its failed peers
    bytes_downloaded: float = 0
    bytes_from_peers: float = 0
    bytes_served: float = 0
    peer_fallbacks: float = 0
    peer_corruptions: float = 0
    requests: Counter[str] = field(default_factory=Counter)
    verified: Counter[str] = field(default_factory=Counter)  # shards downloaded, by method
    retries: Counter[str] = field(default_factory=Counter)
    integrity_redownloads: float = 0
    lock_waits: float = 0
    lock_wait_s: float = 0
    lock_worst_s: float = 0
    lock_worst_holder: str | None = None
    stall_warnings: float = 0
    stall_errors: float = 0
    delivery_checks: float = 0
    delivery_mismatches: float = 0
    # data wait: (waited, covered, carried) for main-process and worker records
    main_wait: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    worker_wait: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    slowest: dict[str, tuple[float, float]] = field(default_factory=dict)  # url -> (s, bytes)
    sources: dict[str, Counter[str]] = field(default_factory=dict)  # mixture source -> counts

    def add(self, record: dict[str, Any], begin: float, end: float) -> None:
        n = mr.number
        host = record.get("host")
        if isinstance(host, str):
            self.hosts.add(host)
        self.processes.add((host, record.get("pid")))
        worker = record.get("worker")
        if isinstance(worker, int) and not isinstance(worker, bool):
            self.workers.add(worker)
        self.records += 1
        self.first, self.last = min(self.first, begin), max(self.last, end)
        for name in mr.COUNTS:  # each a field of this summary
            setattr(self, name, getattr(self, name) + n(record, name))
        self.requests.update(mr.counts(record, "requests"))
        self.verified.update(mr.counts(record, "verified"))  # none in records before it
        self.retries.update(mr.counts(record, "retries"))
        self._add_lock_waits(record.get("lock_waits"))
        wait = mr.optional_number(record, "data_wait_s")
        if wait is not None:
            acc = self.main_wait if mr.is_main_process(record) else self.worker_wait
            acc[0] += wait
            acc[1] += end - begin
            acc[2] += 1
        self._add_slowest(record.get("slowest_shards"))
        self.add_sources(mr.sources(record))

    def add_sources(self, sources: dict[str, Any]) -> None:
        """Add counts per mixture source (``{name: {count: n}}``)."""
        for name, counts in sources.items():
            self.sources.setdefault(name, Counter()).update(counts)

    def _add_lock_waits(self, waits: Any) -> None:
        if not isinstance(waits, dict):
            return
        self.lock_waits += mr.number(waits, "count")
        self.lock_wait_s += mr.number(waits, "seconds")
        worst = mr.number(waits, "worst_s")
        if worst > self.lock_worst_s:
            holder = waits.get("worst_holder")
            self.lock_worst_s = worst
            self.lock_worst_holder = holder if isinstance(holder, str) else None

    def _add_slowest(self, shards: Any) -> None:
        if not isinstance(shards, list):
            return
        for item in shards:
            if not isinstance(item, dict) or not isinstance(item.get("url"), str):
                continue
            url, seconds = redact_url(item["url"]), mr.number(item, "seconds")
            if seconds > self.slowest.get(url, (-1.0, 0.0))[0]:
                self.slowest[url] = (seconds, mr.number(item, "bytes"))

    # ------------------------------------------------------------------ derived values

    @property
    def data_wait_source(self) -> str | None:
        if self.worker_wait[2]:
            return "workers"
        return "main" if self.main_wait[2] else None

    @property
    def data_wait(self) -> tuple[float, float]:
        """(seconds waited, seconds covered) from the records the share comes from."""
        acc = self.worker_wait if self.worker_wait[2] else self.main_wait
        return acc[0], acc[1]

    @property
    def data_wait_share(self) -> float | None:
        waited, covered = self.data_wait
        if self.data_wait_source is None or covered <= 0:
            return None
        return min(1.0, waited / covered)

    @property
    def span_s(self) -> float:
        return max(0.0, self.last - self.first) if self.records else 0.0

    @property
    def samples_per_s(self) -> float | None:
        return self.samples / self.span_s if self.span_s > 0 else None

    @property
    def hit_rate(self) -> float | None:
        fetched = self.hits + self.misses + self.shared + self.from_peers
        return self.hits / fetched if fetched else None

    def slowest_shards(self, k: int = SHARDS_PER_RANK) -> list[dict[str, Any]]:
        ordered = sorted(self.slowest.items(), key=lambda kv: -kv[1][0])
        return [{"url": u, "seconds": s, "bytes": int(b)} for u, (s, b) in ordered[:k]]

    def badness(self) -> tuple[float, ...]:
        share = self.data_wait_share
        return (
            -(share if share is not None else -1.0),
            -self.stall_errors,
            -self.stall_warnings,
            -sum(self.retries.values()),
            self.rank if self.rank is not None else float("inf"),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "hosts": sorted(self.hosts),
            "processes": len(self.processes),
            "workers": sorted(self.workers),
            "records": self.records,
            "first": self.first if self.records else None,
            "last": self.last if self.records else None,
            "span_s": self.span_s,
            "samples": int(self.samples),
            "samples_per_s": self.samples_per_s,
            "shards": int(self.shards),
            "hits": int(self.hits),
            "misses": int(self.misses),
            "shared": int(self.shared),
            "from_peers": int(self.from_peers),
            "hit_rate": self.hit_rate,
            "bytes_downloaded": int(self.bytes_downloaded),
            "bytes_from_peers": int(self.bytes_from_peers),
            "peer_fallbacks": int(self.peer_fallbacks),
            "peer_corruptions": int(self.peer_corruptions),
            "bytes_served": int(self.bytes_served),
            "requests": {k: int(v) for k, v in sorted(self.requests.items())},
            "verified": {k: int(v) for k, v in sorted(self.verified.items()) if v},
            "retries": {k: int(v) for k, v in sorted(self.retries.items())},
            "integrity_redownloads": int(self.integrity_redownloads),
            "lock_waits": {
                "count": int(self.lock_waits),
                "seconds": self.lock_wait_s,
                "worst_s": self.lock_worst_s,
                "worst_holder": self.lock_worst_holder,
            },
            "data_wait_s": self.data_wait[0],
            "data_wait_covered_s": self.data_wait[1],
            "data_wait_share": self.data_wait_share,
            "data_wait_source": self.data_wait_source,
            "stall_warnings": int(self.stall_warnings),
            "stall_errors": int(self.stall_errors),
            "delivery_checks": int(self.delivery_checks),
            "delivery_mismatches": int(self.delivery_mismatches),
            "slowest_shards": self.slowest_shards(),
            "sources": {
                name: {key: int(counts[key]) for key in mr.SOURCE_COUNTS}
                for name, counts in sorted(self.sources.items())
            },
        }


@dataclass
class JobReport:
    """One job's ranks, worst first, and their totals."""

    job_id: str | None
    ranks: list[RankSummary]
    total: RankSummary
    world_size: int | None
    epochs: list[int]
    segments: list[Segment] = field(default_factory=list, repr=False)

    @property
    def missing_ranks(self) -> list[int]:
        if not self.world_size:
            return []
        seen = {r.rank for r in self.ranks}
        return [r for r in range(self.world_size) if r not in seen]

    def slowest_shards(self, k: int) -> list[dict[str, Any]]:
        rows = [
            {**item, "rank": rank.rank}
            for rank in self.ranks
            for item in rank.slowest_shards(len(rank.slowest))
        ]
        rows.sort(key=lambda row: -row["seconds"])
        return rows[:k] if k else rows

    def as_json(self, top: int) -> dict[str, Any]:
        total = self.total.as_json()
        for key in ("rank", "slowest_shards", "workers"):
            total.pop(key)
        total["data_wait_source"] = "ranks"  # their shares, weighted by covered time
        return {
            "job_id": self.job_id,
            "world_size": self.world_size,
            "epochs": self.epochs,
            "missing_ranks": self.missing_ranks,
            "ranks": [r.as_json() for r in self.ranks],
            "total": total,
            "slowest_shards": self.slowest_shards(top),
        }


@dataclass
class Report:
    """What ``shardcache report`` prints (as text: ``_ops.report_text.format_report``)."""

    root: Path
    files: int
    lines: int
    skipped: Counter[str]
    unreadable: list[tuple[str, str]]
    epoch: int | None
    jobs: list[JobReport]

    def as_json(self, top: int = DEFAULT_TOP) -> dict[str, Any]:
        return {
            "dir": str(self.root),
            "files": self.files,
            "lines": self.lines,
            "skipped": dict(self.skipped),
            "unreadable": [{"path": p, "error": e} for p, e in self.unreadable],
            "epoch": self.epoch,
            "jobs": [job.as_json(top) for job in self.jobs],
        }


# ---------------------------------------------------------------------------- reading


def _read_lines(root: Path) -> tuple[list[dict[str, Any]], int, int, Counter[str], list]:
    files = sorted(p for p in root.rglob("*.jsonl") if p.is_file())
    records: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    unreadable: list[tuple[str, str]] = []
    lines = 0
    for path in files:
        try:
            with path.open("rb") as f:
                for number, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    lines += 1
                    try:
                        obj = json.loads(raw)
                    except ValueError:
                        skipped["not JSON"] += 1
                        continue
                    verdict = mr.classify(obj)
                    if verdict == mr.NEWER:
                        raise MetricsError(
                            f"{path}:{number} is a shardcache.metrics record of version "
                            f"{obj['version']}; this shardcache reads version {mr.VERSION} "
                            "(a newer version changes what a field means). Upgrade shardcache "
                            "to report it.",
                            path=str(path),
                            line=number,
                            version=obj["version"],
                        )
                    if verdict != mr.OK:
                        skipped[verdict] += 1
                        continue
                    records.append(obj)
        except OSError as exc:
            unreadable.append((str(path), f"{type(exc).__name__}: {exc.strerror or exc}"))
    return records, len(files), lines, skipped, unreadable


def _key_text(value: Any) -> str | None:
    return None if value is None else str(value)


def _rank_of(record: dict[str, Any]) -> int | None:
    rank = record.get("rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def build_report(root: Path, *, epoch: int | None = None, job: str | None = None) -> Report:
    """Read every ``*.jsonl`` under ``root`` and sum its records per job and rank
    (only epoch ``epoch`` / job ``job`` when given).

    Raises :class:`MetricsError` for a record of a newer schema version, or when no record
    at all is left to report (the message says how many files and lines were read, and
    why lines were skipped).
    """
    records, files, lines, skipped, unreadable = _read_lines(root)
    records.sort(key=lambda r: mr.number(r, "time"))
    clock = mr.PeriodClock()
    jobs: dict[str | None, dict[int | None, RankSummary]] = {}
    segments: dict[str | None, list[Segment]] = {}
    world: dict[str | None, int] = {}
    epochs: dict[str | None, set[int]] = {}
    for record in records:
        # Covered time is computed over every record, so a filtered epoch's first record
        # still starts where the process's previous record ended.
        begin, end = clock.covered(record)
        rec_epoch, rec_job = record.get("epoch"), _key_text(record.get("job_id"))
        if (epoch is not None and rec_epoch != epoch) or (job is not None and rec_job != job):
            continue
        rank = _rank_of(record)
        summary = jobs.setdefault(rec_job, {}).get(rank)
        if summary is None:
            summary = jobs[rec_job][rank] = RankSummary(rec_job, rank)
        summary.add(record, begin, end)
        if isinstance(rec_epoch, int):
            epochs.setdefault(rec_job, set()).add(rec_epoch)
        size = record.get("world_size")
        if isinstance(size, int) and not isinstance(size, bool):
            world[rec_job] = max(world.get(rec_job, 0), size)
        segments.setdefault(rec_job, []).append(
            Segment(
                rank,
                begin,
                end,
                mr.number(record, "samples"),
                mr.optional_number(record, "data_wait_s"),
                mr.is_main_process(record),
                rec_epoch if isinstance(rec_epoch, int) else None,
            )
        )
    if not jobs:
        why = ", ".join(f"{n} {reason}" for reason, n in skipped.items()) or "none skipped"
        which = (f" of epoch {epoch}" if epoch is not None else "") + (
            f" of job {job}" if job is not None else ""
        )
        raise MetricsError(
            f"no shardcache.metrics records{which} under {root}: {files} *.jsonl files, "
            f"{lines} lines ({why}). Set SHARDCACHE_METRICS=DIR for the job to write them.",
            path=str(root),
        )
    reports = [
        _job_report(key, ranks, world.get(key), epochs.get(key, set()), segments[key])
        for key, ranks in jobs.items()
    ]
    reports.sort(key=lambda j: -j.total.last)  # the latest job first
    return Report(root, files, lines, skipped, unreadable, epoch, reports)


def _job_report(
    job: str | None,
    ranks: dict[int | None, RankSummary],
    world_size: int | None,
    epochs: set[int],
    segments: list[Segment],
) -> JobReport:
    ordered = sorted(ranks.values(), key=RankSummary.badness)
    total = RankSummary(job, None)
    for rank in ordered:
        _merge(total, rank)
    return JobReport(job, ordered, total, world_size, sorted(epochs), segments)


def _merge(total: RankSummary, rank: RankSummary) -> None:
    """Add ``rank`` into the job's total. The total's data-wait share is the mean over
    ranks weighted by covered time; its samples/s is the job's: all samples over the span."""
    total.hosts |= rank.hosts
    total.processes |= {(rank.rank, *p) for p in rank.processes}  # type: ignore[arg-type]
    total.records += rank.records
    total.first, total.last = min(total.first, rank.first), max(total.last, rank.last)
    for name in (*mr.COUNTS, "lock_waits", "lock_wait_s"):
        setattr(total, name, getattr(total, name) + getattr(rank, name))
    total.requests.update(rank.requests)
    total.verified.update(rank.verified)
    total.retries.update(rank.retries)
    total.add_sources(rank.sources)
    if rank.lock_worst_s > total.lock_worst_s:
        total.lock_worst_s, total.lock_worst_holder = rank.lock_worst_s, rank.lock_worst_holder
    if rank.data_wait_source is not None:
        waited, covered = rank.data_wait
        total.main_wait[0] += waited
        total.main_wait[1] += covered
        total.main_wait[2] += 1


__all__ = ["DEFAULT_TOP", "JobReport", "RankSummary", "Report", "Segment", "build_report"]
