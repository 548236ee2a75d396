"""``shardcache report --plot OUT.png``: data-wait share and samples/s per rank over time.

The timeline is computed here without matplotlib (:func:`timeline`); only :func:`plot`
imports it, with the Agg backend (no display), and says which extra to install when it is
missing. Each record's counts are spread evenly over the time it covers, into equal time
bins, so records of any interval (and an epoch's remainder record) line up.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .._base.extras import require_extras
from .report import JobReport, Segment

MAX_BINS = 240
LABELLED = 5  # the worst ranks drawn in colour and named in the legend


@dataclass
class Timeline:
    """Per rank, per time bin: data-wait share (NaN: no record covers it) and samples/s."""

    start: float
    width: float
    ranks: list[int | None]  # worst first, as in the report
    share: dict[int | None, list[float]]
    rate: dict[int | None, list[float]]
    epoch_starts: dict[int, float]  # epoch -> unix time of its first record's begin

    @property
    def bins(self) -> int:
        return len(next(iter(self.rate.values()), []))

    @property
    def unit(self) -> tuple[float, str]:
        """(seconds per unit, name) of the time axis: seconds for a job of up to 3 minutes."""
        return (1.0, "seconds") if self.width * self.bins <= 180 else (60.0, "minutes")

    def at(self, when: float) -> float:
        """``when`` (unix time) on the time axis."""
        return (when - self.start) / self.unit[0]

    def edges(self) -> list[float]:
        """Bin edges on the time axis (one more than the bins)."""
        return [i * self.width / self.unit[0] for i in range(self.bins + 1)]


def timeline(job: JobReport) -> Timeline:
    segments = job.segments
    start = min(s.begin for s in segments)
    span = max(max(s.end for s in segments) - start, 1e-9)
    lengths = [s.end - s.begin for s in segments if s.end > s.begin]
    typical = max(statistics.median(lengths) if lengths else span, span / MAX_BINS)
    # Bins tile the span exactly: a last bin mostly after the job's end would read as a
    # drop to 0 samples/s.
    bins = max(1, min(MAX_BINS, round(span / typical)))
    width = span / bins
    ranks = [r.rank for r in job.ranks]
    samples = {r: [0.0] * bins for r in ranks}
    waited = {r: [0.0] * bins for r in ranks}
    covered = {r: [0.0] * bins for r in ranks}
    source = {r.rank: r.data_wait_source for r in job.ranks}
    for seg in segments:
        _spread(samples[seg.rank], seg, seg.samples, start, width)
        if seg.data_wait_s is not None and source[seg.rank] == ("main" if seg.main else "workers"):
            _spread(waited[seg.rank], seg, seg.data_wait_s, start, width)
            _spread(covered[seg.rank], seg, seg.end - seg.begin, start, width)
    share = {
        r: [
            min(1.0, w / c) if c > 0 else math.nan
            for w, c in zip(waited[r], covered[r], strict=True)
        ]
        for r in ranks
    }
    rate = {r: [n / width for n in samples[r]] for r in ranks}
    epochs: dict[int, float] = {}
    for seg in segments:
        if seg.epoch is not None and seg.end > seg.begin:
            epochs[seg.epoch] = min(epochs.get(seg.epoch, seg.begin), seg.begin)
    return Timeline(start, width, ranks, share, rate, dict(sorted(epochs.items())))


def _spread(bins: list[float], seg: Segment, value: float, start: float, width: float) -> None:
    """Add ``value`` to ``bins`` in proportion to the overlap of ``seg`` with each bin."""
    if not value:
        return
    last = len(bins) - 1
    if seg.end <= seg.begin:
        bins[min(last, max(0, int((seg.end - start) / width)))] += value
        return
    per_second = value / (seg.end - seg.begin)
    first = min(last, max(0, int((seg.begin - start) / width)))
    for i in range(first, last + 1):
        lo, hi = start + i * width, start + (i + 1) * width
        if lo >= seg.end:
            break
        overlap = min(hi, seg.end) - max(lo, seg.begin)
        if overlap > 0:
            bins[i] += per_second * overlap


def plot(job: JobReport, out: Path) -> Timeline:
    """Draw ``job``'s timeline into the PNG ``out``; returns what was drawn."""
    require_extras("shardcache report --plot", "plot")
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot

    line = timeline(job)
    x = line.edges()
    fig, (ax_wait, ax_rate) = pyplot.subplots(
        2, 1, sharex=True, figsize=(11, 6.5), constrained_layout=True
    )
    try:
        named = line.ranks[:LABELLED]
        colours = pyplot.get_cmap("tab10").colors  # type: ignore[attr-defined]
        by_rank = {r.rank: r for r in job.ranks}
        for epoch, begin in line.epoch_starts.items():
            if begin > line.start:
                for ax in (ax_wait, ax_rate):
                    ax.axvline(line.at(begin), color="0.5", linestyle=":")
                ax_wait.annotate(
                    f" epoch {epoch}",
                    (line.at(begin), 1.0),
                    xycoords=("data", "axes fraction"),
                    va="top",
                    fontsize="small",
                    color="0.4",
                )
        # Ordinary ranks first, thin and grey, so the worst ones are drawn on top.
        for rank in reversed(line.ranks):
            if rank in named:
                i = named.index(rank)
                overall = by_rank[rank].data_wait_share
                label = f"rank {'?' if rank is None else rank}" + (
                    f" ({overall:.0%} waiting)" if overall is not None else ""
                )
                style = {"color": colours[i % len(colours)], "linewidth": 1.8, "label": label}
            else:
                style = {"color": "0.72", "linewidth": 0.8, "label": None}
            style["drawstyle"] = "steps-post"  # binned values, not samples of a curve
            # steps-post over the edges: each bin's value held across the whole bin
            share = [v * 100 for v in line.share[rank]]
            ax_wait.plot(x, [*share, share[-1]], **style)
            ax_rate.plot(x, [*line.rate[rank], line.rate[rank][-1]], **style)
        others = len(line.ranks) - len(named)
        if others > 0:
            ax_wait.plot([], [], color="0.72", linewidth=0.8, label=f"{others} other ranks")
        ax_wait.set_ylabel("data-wait share (%)")
        ax_wait.set_ylim(0, 100)
        ax_rate.set_ylabel("samples/s")
        ax_rate.set_ylim(bottom=0)
        ax_rate.set_xlabel(f"{line.unit[1]} since {_when(line.start)} (bins of {line.width:.3g} s)")
        for ax in (ax_wait, ax_rate):
            ax.grid(True, color="0.9")
        handles, labels = ax_wait.get_legend_handles_labels()
        # worst first (they were drawn last, on top), "N other ranks" at the end
        order = sorted(range(len(labels)), key=lambda i: (labels[i].endswith("ranks"), -i))
        ax_wait.legend(
            [handles[i] for i in order],
            [labels[i] for i in order],
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize="small",
            title="worst ranks first",
        )
        name = f"job {job.job_id}" if job.job_id is not None else "job (no job id)"
        ax_wait.set_title(f"shardcache: {name}, {len(line.ranks)} ranks")
        fig.savefig(out, dpi=100)
    finally:
        pyplot.close(fig)
    return line


def _when(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


__all__ = ["Timeline", "plot", "timeline"]
