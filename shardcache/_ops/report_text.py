"""The text form of ``shardcache report``: per job a header, one table (worst ranks first,
then a totals row), the downloads by verification method, the worst ranks' retries, lock
waits and stalls, the slowest shards, and the counts per mixture source."""

from __future__ import annotations

import time
from collections.abc import Iterable

from .._base.units import format_bytes
from .report import DEFAULT_TOP, JobReport, RankSummary, Report

HEADER = (
    "rank",
    "host",
    "wait",
    "samples",
    "samples/s",
    "shards",
    "hits",
    "misses",
    "shared",
    "downloaded",
    "served",
    "GETs",
    "retries",
    "integrity",
    "lock waits",
    "stalls w/e",
)
NUMERIC = {i for i, name in enumerate(HEADER) if name not in ("rank", "host")}


def format_report(report: Report, top: int = DEFAULT_TOP) -> str:
    skipped = sum(report.skipped.values())
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(report.skipped.items()))
    lines = [
        f"shardcache report {report.root}: {report.files} files, {report.lines} lines"
        + (f", {skipped} skipped ({why})" if skipped else "")
        + (f"; epoch {report.epoch} only" if report.epoch is not None else "")
    ]
    lines += [f"  unreadable: {path}: {error}" for path, error in report.unreadable]
    if len(report.jobs) > 1:
        names = ", ".join(_job_name(job) for job in report.jobs)
        lines.append(f"{len(report.jobs)} jobs in this directory, one table each: {names}")
    for job in report.jobs:
        lines += ["", *_job_lines(job, top)]
    return "\n".join(lines)


def _job_name(job: JobReport) -> str:
    return f"job {job.job_id}" if job.job_id is not None else "job (no job id)"


def _job_lines(job: JobReport, top: int) -> list[str]:
    total = job.total
    epochs = ""
    if job.epochs:
        first, last = job.epochs[0], job.epochs[-1]
        epochs = f"; epoch {first}" if first == last else f"; epochs {first}-{last}"
    world = f" of world size {job.world_size}" if job.world_size else ""
    lines = [
        f"{_job_name(job)}: {len(job.ranks)} ranks{world} on {_hosts(len(total.hosts))}, "
        f"{total.records} records, {_when(total.first)} to {_when(total.last)} "
        f"({_duration(total.span_s)}){epochs}"
    ]
    if job.missing_ranks:
        lines.append(f"no records from ranks {_ranges(job.missing_ranks)}")
    shown = job.ranks[:top] if top else job.ranks
    rows = [HEADER, *(_row(rank) for rank in shown)]
    rows.append(_row(total, label="total"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    for n, row in enumerate(rows):
        if n == len(rows) - 1 and len(shown) < len(job.ranks):
            more = len(job.ranks) - len(shown)
            lines.append(f"... {more} more ranks (--top 0 shows all)")
        cells = (
            c.rjust(w) if i in NUMERIC else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        lines.append("  ".join(cells).rstrip())
    lines += _wait_note(job)
    lines += _verified_lines(total)
    lines += _peer_lines(total)
    lines += _source_lines(total)
    lines += _delivery_lines(total)
    details = [line for rank in shown for line in _details(rank)]
    if details:
        lines += ["worst ranks in detail:", *details]
    slowest = job.slowest_shards(top)
    if slowest:
        lines.append("slowest shards:")
        lines += [
            f"  {s['seconds']:7.1f} s  {format_bytes(s['bytes']):>9}  rank {_rank(s['rank'])}  "
            f"{s['url']}"
            for s in slowest
        ]
    return lines


def _row(rank: RankSummary, label: str | None = None) -> tuple[str, ...]:
    share, rate, hits = rank.data_wait_share, rank.samples_per_s, rank.hit_rate
    return (
        label or _rank(rank.rank),
        ",".join(sorted(rank.hosts)) if label is None else _hosts(len(rank.hosts)),
        "-" if share is None else f"{share:.1%}",
        f"{rank.samples:.0f}",
        "-" if rate is None else f"{rate:.1f}",
        f"{rank.shards:.0f}",
        "-" if hits is None else f"{hits:.0%}",
        f"{rank.misses:.0f}",
        f"{rank.shared:.0f}",
        format_bytes(rank.bytes_downloaded),
        format_bytes(rank.bytes_served),
        f"{rank.requests.get('GET', 0):.0f}",
        f"{sum(rank.retries.values()):.0f}",
        f"{rank.integrity_redownloads:.0f}",
        f"{rank.lock_waits:.0f}/{rank.lock_wait_s:.1f}s",
        f"{rank.stall_warnings:.0f}/{rank.stall_errors:.0f}",
    )


def _verified_lines(total: RankSummary) -> list[str]:
    """The job's downloaded shards by how they were verified, if any were counted."""
    methods = [(m, n) for m, n in sorted(total.verified.items(), key=lambda i: (-i[1], i[0])) if n]
    if not methods:
        return []
    return ["downloads verified by: " + ", ".join(f"{m} {n:.0f}" for m, n in methods)]


def _peer_lines(total: RankSummary) -> list[str]:
    """The job's shards filled from peers of the cache mesh and its failed peers, if any."""
    if not total.from_peers and not total.peer_fallbacks:
        return []
    return [
        f"from peers of the cache mesh: {total.from_peers:.0f} shards "
        f"({format_bytes(total.bytes_from_peers)}), {total.peer_fallbacks:.0f} peers failed "
        f"({total.peer_corruptions:.0f} with a damaged copy)"
    ]


def _source_lines(total: RankSummary) -> list[str]:
    """The job's counts per mixture source, if it read a mixture."""
    if not total.sources:
        return []
    lines = ["by mixture source:"]
    for name, c in sorted(total.sources.items()):
        lines.append(
            f"  {name}: {c['samples']:.0f} samples, {c['hits']:.0f} hits, "
            f"{c['misses']:.0f} misses, {c['shared']:.0f} shared, "
            f"{format_bytes(c['bytes_downloaded'])} downloaded, "
            f"{format_bytes(c['bytes_served'])} served"
        )
    return lines


def _delivery_lines(total: RankSummary) -> list[str]:
    """The job's delivery checks (resumable datasets), if any were made."""
    if not total.delivery_checks:
        return []
    checks, bad = total.delivery_checks, total.delivery_mismatches
    if not bad:
        return [f"delivery checks: {checks:.0f}, all matched the plan"]
    return [
        f"delivery checks: {checks:.0f}, {bad:.0f} MISMATCHED the plan (samples skipped or "
        "repeated; the DeliveryMismatchError or warning says where)"
    ]


def _hosts(count: int) -> str:
    return f"{count} host" if count == 1 else f"{count} hosts"


def _wait_note(job: JobReport) -> list[str]:
    by_source: dict[str | None, list[int | None]] = {}
    for rank in job.ranks:
        by_source.setdefault(rank.data_wait_source, []).append(rank.rank)
    lines = [
        "wait: share of the time the data path waited for shards, measured where the stage "
        "runs (a rank's",
        "  DataLoader workers, or its training process without workers); hits: shards served "
        "from the cache;",
        "  lock waits: count/seconds; stalls: warnings/errors",
    ]
    if "main" in by_source:
        lines.append(
            f"  ranks {_ranges(by_source['main'])}: wait from the training process's records "
            "(no DataLoader worker recorded any)"
        )
    if None in by_source:
        lines.append(f"  ranks {_ranges(by_source[None])}: no record carries data_wait_s")
    return lines


def _details(rank: RankSummary) -> list[str]:
    parts = []
    if rank.retries and sum(rank.retries.values()):
        causes = ", ".join(f"{c} {n:.0f}" for c, n in rank.retries.most_common() if n)
        parts.append(f"retries {causes}")
    if rank.integrity_redownloads:
        parts.append(f"integrity re-downloads {rank.integrity_redownloads:.0f}")
    if rank.lock_waits:
        holder = f" held by {rank.lock_worst_holder}" if rank.lock_worst_holder else ""
        parts.append(
            f"lock waits {rank.lock_waits:.0f} ({rank.lock_wait_s:.1f} s, worst "
            f"{rank.lock_worst_s:.1f} s{holder})"
        )
    if rank.stall_warnings or rank.stall_errors:
        parts.append(f"stalls {rank.stall_warnings:.0f} warnings, {rank.stall_errors:.0f} errors")
    if rank.delivery_mismatches:
        parts.append(
            f"DELIVERY MISMATCHES {rank.delivery_mismatches:.0f} of "
            f"{rank.delivery_checks:.0f} checks (samples skipped or repeated)"
        )
    if not parts:
        return []
    host = ",".join(sorted(rank.hosts))
    return [f"  rank {_rank(rank.rank)} ({host}): " + "; ".join(parts)]


def _rank(rank: int | None) -> str:
    return "?" if rank is None else str(rank)


def _ranges(ranks: Iterable[int | None]) -> str:
    """``[0, 1, 2, 5, None]`` -> ``"0-2, 5, ?"``."""
    ranks = list(ranks)
    known = sorted(r for r in ranks if r is not None)
    parts: list[str] = []
    for r in known:
        if parts and parts[-1].split("-")[-1] == str(r - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    if len(known) < len(ranks):
        parts.append("?")
    return ", ".join(parts)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


__all__ = ["format_report"]
