"""The loader report's arithmetic and its lines: records summed into one report
(:func:`merge`), a rank's line (:func:`format_line`) and the job's line of an epoch
(:func:`format_job_line`).

A report is a dict shaped like a metrics record (``shardcache._observe.metric_records``; the same
keys, ``kind`` "report", ``sources`` when a mixture counted), with counts summed over the
records it was made of, plus ``processes`` (how many processes contributed) and
``consumer_s`` (the seconds the consuming processes ran: ``data_wait_share`` is
``data_wait_s / consumer_s``). Pure functions of records: the collector (``_observe.metrics``) and
``log_epoch_summary`` (``_observe.loader_report``) both build on them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .metric_records import COUNTS, RETRY_CAUSES, SOURCE_COUNTS

_SUMMED = (*COUNTS, "data_wait_s")
WORST_RANKS = 3  # ranks named in the job's line


def merge(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One report summing ``records`` (raw records of any processes, or reports)."""
    records = list(records)
    out: dict[str, Any] = {
        "schema": "shardcache.metrics",
        "version": 1,
        "kind": "report",
        **dict.fromkeys(_SUMMED, 0),
        "requests": {},
        "verified": {},
        "retries": {},
        "lock_waits": {"count": 0, "seconds": 0.0, "worst_s": 0.0, "worst_holder": None},
        "slowest_shards": [],
    }
    sources: dict[str, dict[str, Any]] = {}
    spans: dict[tuple[Any, Any], list[float]] = {}  # (host, pid) of raw records: start, end
    consumed: set[tuple[Any, Any]] = set()
    consumer_s = 0.0
    processes = 0
    for r in records:
        for name in _SUMMED:
            out[name] += r.get(name, 0)
        for method, n in r.get("requests", {}).items():
            out["requests"][method] = out["requests"].get(method, 0) + n
        for method, n in r.get("verified", {}).items():  # records before it have none
            out["verified"][method] = out["verified"].get(method, 0) + n
        for cause, n in r.get("retries", {}).items():
            out["retries"][cause] = out["retries"].get(cause, 0) + n
        waits, mine = out["lock_waits"], r.get("lock_waits", {})
        waits["count"] += mine.get("count", 0)
        waits["seconds"] += mine.get("seconds", 0.0)
        if mine.get("count") and mine.get("worst_s", 0.0) >= waits["worst_s"]:
            waits["worst_s"], waits["worst_holder"] = mine["worst_s"], mine.get("worst_holder")
        out["slowest_shards"].extend(r.get("slowest_shards", []))
        for name, mine in r.get("sources", {}).items():
            theirs = sources.setdefault(name, dict.fromkeys(SOURCE_COUNTS, 0))
            for key in SOURCE_COUNTS:
                theirs[key] += mine.get(key, 0)
        if "consumer_s" in r:  # a report already
            consumer_s += r["consumer_s"]
            processes += r.get("processes", 1)
            continue
        key = (r.get("host"), r.get("pid"))
        span = spans.setdefault(key, [r["start"], r["time"]])
        span[0], span[1] = min(span[0], r["start"]), max(span[1], r["time"])
        if r.get("shards") or r.get("data_wait_s"):
            consumed.add(key)
    processes += len(spans)
    consumer_s += sum(end - start for key, (start, end) in spans.items() if key in consumed)
    out["slowest_shards"] = sorted(out["slowest_shards"], key=lambda e: -e["seconds"])[:5]
    out["data_wait_s"] = round(out["data_wait_s"], 6)
    out["lock_waits"]["seconds"] = round(out["lock_waits"]["seconds"], 6)
    out["consumer_s"] = round(consumer_s, 6)
    out["data_wait_share"] = (
        round(min(1.0, out["data_wait_s"] / consumer_s), 6) if consumer_s else 0.0
    )
    out["processes"] = processes
    if sources:
        out["sources"] = dict(sorted(sources.items()))
    if records:
        out["start"] = min(r["start"] for r in records)
        out["time"] = max(r["time"] for r in records)
        out["period_s"] = round(out["time"] - out["start"], 6)
        for name in ("job_id", "rank", "epoch", "world_size", "host"):
            values = {r.get(name) for r in records}
            out[name] = values.pop() if len(values) == 1 else None
        out["ranks"] = len({r.get("rank") for r in records})
    else:
        out.update(start=None, time=None, period_s=0.0, ranks=0)
        out.update(dict.fromkeys(("job_id", "rank", "epoch", "world_size", "host")))
    return out


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _verified(methods: dict[str, Any]) -> str:
    """`` (verified: md5-parts 3, size 1)``, the downloaded shards by method; "" if none."""
    shown = ", ".join(
        f"{m} {n}" for m, n in sorted(methods.items(), key=lambda i: (-i[1], i[0])) if n
    )
    return f" (verified: {shown})" if shown else ""


def _from_peers(r: dict[str, Any]) -> str:
    """``, 5 from peers (1.2 GB; 2 failed, 1 damaged)`` where the cache mesh filled a shard
    or a peer failed; "" otherwise."""
    filled, failed = r.get("from_peers", 0), r.get("peer_fallbacks", 0)
    if not filled and not failed:
        return ""
    text = f", {filled} from peers ({_size(r.get('bytes_from_peers', 0))}"
    if failed:
        text += f"; {failed} failed, {r.get('peer_corruptions', 0)} damaged"
    return text + ")"


def _body(r: dict[str, Any]) -> str:
    retries = r["retries"]
    requests = r["requests"]
    parts = [
        f"{r['samples']} samples",
        f"{r['shards']} shards ({r['hits']} hits, {r['misses']} misses, {r['shared']} shared"
        + _from_peers(r)
        + ")",
        f"{_size(r['bytes_served'])} served",
        f"{_size(r['bytes_downloaded'])} downloaded" + _verified(r.get("verified", {})),
        f"{requests.get('GET', 0)} GETs"
        + (f", {requests['HEAD']} HEADs" if requests.get("HEAD") else ""),  # revalidation
        "retries reset {} / 5xx {} / SlowDown {} / truncated {} / other {}".format(
            *(retries.get(c, 0) for c in RETRY_CAUSES)
        ),
    ]
    if r["integrity_redownloads"]:
        parts.append(f"{r['integrity_redownloads']} integrity re-downloads")
    waits = r["lock_waits"]
    if waits["count"]:
        holder = f" on {waits['worst_holder']}" if waits["worst_holder"] else ""
        parts.append(
            f"lock waits {waits['count']} ({waits['seconds']:.1f} s, worst "
            f"{waits['worst_s']:.1f} s{holder})"
        )
    else:
        parts.append("lock waits 0")
    parts.append(f"waited for data {100 * r['data_wait_share']:.0f} % of {r['consumer_s']:.0f} s")
    parts.append(f"stalls {r['stall_warnings']} warnings / {r['stall_errors']} errors")
    if r.get("delivery_checks"):
        mismatches = r.get("delivery_mismatches", 0)
        parts.append(
            f"delivery checks {r['delivery_checks']}, "
            + (
                f"{mismatches} MISMATCHED (samples skipped or repeated)"
                if mismatches
                else "all matched"
            )
        )
    if r["slowest_shards"]:
        slowest = r["slowest_shards"][0]
        parts.append(f"slowest {slowest['url']} {slowest['seconds']:.1f} s")
    line = ", ".join(parts)
    if r.get("sources"):
        line += "; by source: " + "; ".join(
            f"{name} {c['samples']} samples ({c['hits']} hits, {c['misses']} misses, "
            f"{c['shared']} shared, {_size(c['bytes_downloaded'])} downloaded)"
            for name, c in r["sources"].items()
        )
    return line


def format_line(report: dict[str, Any]) -> str:
    """The concise line of one rank's report (``shardcache rank 3 epoch 2: ...``)."""
    epoch = "" if report.get("epoch") is None else f" epoch {report['epoch']}"
    rank = "?" if report.get("rank") is None else report["rank"]
    return f"shardcache rank {rank}{epoch}: {_body(report)}"


def format_job_line(reports: list[dict[str, Any]]) -> str:
    """The job's line of an epoch from every rank's report: totals and the worst ranks."""
    total = merge(reports)
    epoch = "" if total.get("epoch") is None else f" epoch {total['epoch']}"
    worst = sorted(reports, key=lambda r: -r["data_wait_share"])[:WORST_RANKS]
    named = ", ".join(
        f"rank {r.get('rank')} {100 * r['data_wait_share']:.0f} %"
        f" ({sum(r['retries'].values())} retries, {r['stall_errors']} stall errors)"
        for r in worst
    )
    return (
        f"shardcache job{epoch}, {len(reports)} ranks: {_body(total)}; "
        f"most waiting for data: {named}"
    )
