"""``shardcache report DIR [--plot]``: sums of a job's per-rank metrics files, worst ranks
first, the data-wait share from the right records, tolerance of bad lines and unknown keys,
refusal of a newer schema version, several jobs, and the PNG (opened and measured)."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest
from metrics_records import RANKS, SLOW_RANK, T0, record, write_job, write_records

from shardcache import MetricsError
from shardcache._cli.main import main
from shardcache._ops.report import build_report
from shardcache._ops.report_plot import timeline
from shardcache._ops.report_text import format_report


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "metrics"
    expected = write_job(root)
    # What a killed process and a stray tool leave: half a line, another schema, a blank.
    with (root / "scnode1" / "rank0-main.jsonl").open("a") as f:
        f.write('{"schema": "other", "version": 1}\n\n{"schema": "shardcache.metrics", "ver')
    return root, expected


def test_sums_per_rank_worst_first(job) -> None:
    root, expected = job
    report = build_report(root)
    assert report.files == expected["files"]
    assert dict(report.skipped) == {"not JSON": 1, "not a shardcache.metrics record": 1}
    (only,) = report.jobs
    assert only.job_id == "4242" and only.world_size == RANKS and only.epochs == [0, 1]
    assert only.missing_ranks == []
    ranks = {r.rank: r for r in only.ranks}
    for rank in range(RANKS):
        assert ranks[rank].samples == expected["samples"][rank]
        assert ranks[rank].misses == expected["misses"][rank]
        # the workers' records (the stage runs there), each covering its own 10 s (not
        # the epoch record's start-to-time span of 60 s)
        assert ranks[rank].data_wait_share == pytest.approx(expected["wait"][rank])
        assert ranks[rank].data_wait_source == "workers"
        assert ranks[rank].hosts == {f"scnode{1 + rank // 2}"}
        assert ranks[rank].workers == {0, 1}
    shares = [r.data_wait_share for r in only.ranks]
    assert shares == sorted(shares, reverse=True)
    assert only.ranks[0].rank == SLOW_RANK
    slow = only.ranks[0]
    assert slow.retries["5xx"] == 24 and slow.requests["GET"] == 72
    assert slow.lock_waits == 12 and slow.lock_worst_s == 2.5
    assert slow.lock_worst_holder and slow.lock_worst_holder.endswith("on scnode2")
    assert slow.stall_warnings == 2
    assert only.total.samples == sum(expected["samples"].values())
    assert only.total.misses == sum(expected["misses"].values())
    # the job's share: the ranks' shares weighted by covered time (equal here)
    assert only.total.data_wait_share == pytest.approx(sum(expected["wait"].values()) / RANKS)
    assert only.slowest_shards(3)[0]["rank"] == SLOW_RANK


def test_cli_table_json_epoch_and_top(job, capsys) -> None:
    root, expected = job
    assert main(["report", str(root)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    order = [int(line.split()[0]) for line in lines[header + 1 : header + 1 + RANKS]]
    assert order[0] == SLOW_RANK and sorted(order) == list(range(RANKS))
    assert lines[header + 1 + RANKS].startswith("total")
    assert "2 skipped (1 not JSON, 1 not a shardcache.metrics record)" in out
    assert "rank 2 (scnode2): retries 5xx 24; lock waits 12" in out

    assert main(["report", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (only,) = data["jobs"]
    assert [r["rank"] for r in only["ranks"]] == order
    assert {r["rank"]: r["samples"] for r in only["ranks"]} == expected["samples"]
    assert only["total"]["samples"] == sum(expected["samples"].values())

    # epoch 1: warm cache, no misses, nobody waits much
    assert main(["report", str(root), "--json", "--epoch", "1"]) == 0
    epoch1 = json.loads(capsys.readouterr().out)["jobs"][0]
    assert epoch1["epochs"] == [1] and epoch1["total"]["misses"] == 0
    assert all(r["data_wait_share"] < 0.1 for r in epoch1["ranks"])

    assert main(["report", str(root), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "... 3 more ranks (--top 0 shows all)" in out


def test_data_wait_comes_from_the_workers_when_there_are_any(tmp_path) -> None:
    recs = [
        record(rank=0, worker=w, pid=50 + w, samples=10, data_wait_s=wait)
        for w, wait in ((0, 2.0), (1, 4.0))
    ]
    # the main process only gathers: it waited for nothing itself
    main_rec = record(rank=0, pid=49, samples=0, data_wait_s=0.0)
    write_records(tmp_path / "r0.jsonl", [*recs, main_rec])
    (rank,) = build_report(tmp_path).jobs[0].ranks
    assert rank.data_wait_source == "workers"
    assert rank.data_wait_share == pytest.approx(6.0 / 20.0)
    assert rank.samples == 20


def test_unknown_keys_and_missing_optional_keys_are_tolerated(tmp_path) -> None:
    bare = {"schema": "shardcache.metrics", "version": 1, "time": T0, "rank": 3, "job_id": "4242"}
    odd = record(rank=3, samples=5, future_field={"x": 1}, retries="not a mapping", hits=-4)
    odd["requests"] = {"GET": "many", "HEAD": 2}
    write_records(tmp_path / "r.jsonl", [bare, odd, [1, 2], {"schema": "shardcache.metrics"}])
    report = build_report(tmp_path)
    (rank,) = report.jobs[0].ranks
    assert rank.rank == 3 and rank.records == 2 and rank.samples == 5
    assert rank.hits == 0 and rank.requests == {"GET": 0, "HEAD": 2} and not rank.retries
    assert report.skipped["not a shardcache.metrics record"] == 2
    assert format_report(report)  # formats without the fields it lacks


def test_a_newer_version_is_refused(tmp_path, capsys) -> None:
    path = write_records(tmp_path / "r.jsonl", [record(), record(version=2, time=T0 + 20)])
    with pytest.raises(MetricsError, match="version 2") as info:
        build_report(tmp_path)
    assert info.value.line == 2 and info.value.path == str(path)
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2" in err and "Upgrade shardcache" in err


def test_no_records_is_an_error_that_says_why(tmp_path, capsys) -> None:
    (tmp_path / "x.jsonl").write_text("not json\n")
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "MetricsError: no shardcache.metrics records" in err
    assert "1 *.jsonl files, 1 lines (1 not JSON)" in err


def test_several_jobs_are_reported_one_table_each(tmp_path, capsys) -> None:
    write_job(tmp_path / "a", job_id="100", t0=T0)
    write_job(tmp_path / "b", job_id="101", t0=T0 + 3600)
    report = build_report(tmp_path)
    assert [j.job_id for j in report.jobs] == ["101", "100"]  # latest first
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 jobs in this directory, one table each: job 101, job 100" in out
    assert out.count("\ntotal ") == 2
    assert main(["report", str(tmp_path), "--job", "100", "--json"]) == 0
    assert [j["job_id"] for j in json.loads(capsys.readouterr().out)["jobs"]] == ["100"]


def test_timeline_spreads_records_over_the_time_they_cover(job) -> None:
    root, _expected = job
    (only,) = build_report(root).jobs
    line = timeline(only)
    assert line.ranks[0] == SLOW_RANK
    assert 11 <= line.bins <= 13 and line.width == pytest.approx(121 / line.bins)
    assert line.share[SLOW_RANK][0] == pytest.approx(0.55, abs=0.01)
    assert line.share[0][0] == pytest.approx(0.12, abs=0.01)
    assert all(v < 0.1 for v in line.share[SLOW_RANK][7:])  # epoch 1: warm
    assert not any(math.isnan(v) for r in line.ranks for v in line.share[r])
    total = sum(sum(line.rate[r]) * line.width for r in line.ranks)
    assert total == pytest.approx(only.total.samples)
    assert list(line.epoch_starts) == [0, 1]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_draws_a_png(job, tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    root, _expected = job
    out = tmp_path / "wait.png"
    assert main(["report", str(root), "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"report: plotted job 4242 to {out}" in captured.err
    assert "total" in captured.out
    width, height = _png_size(out)
    assert (width, height) == (1100, 650)
    # Something was drawn: the worst rank's colour (matplotlib's first, #1f77b4) is there.
    from matplotlib import image

    pixels = image.imread(out)
    blue = (abs(pixels[..., 0] - 0x1F / 255) < 0.02) & (abs(pixels[..., 2] - 0xB4 / 255) < 0.02)
    assert blue.sum() > 500


def test_plot_of_records_without_a_job_id_says_so(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    write_records(tmp_path / "m" / "r0.jsonl", [record(rank=0, job_id=None, samples=10)])
    out = tmp_path / "wait.png"
    assert main(["report", str(tmp_path / "m"), "--plot", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"report: plotted the records (they name no job id) to {out}" in err
    assert "None" not in err and out.exists()


def test_plot_without_matplotlib_says_what_to_install(job, tmp_path, capsys, monkeypatch) -> None:
    root, _expected = job
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["report", str(root), "--plot", str(tmp_path / "w.png")]) == 1
    captured = capsys.readouterr()
    assert "pip install 'shardcache[plot]'" in captured.err
    assert captured.out == "" and not (tmp_path / "w.png").exists()


def test_counts_per_mixture_source_are_summed_over_ranks(tmp_path, capsys) -> None:
    def of(samples: int, misses: int) -> dict:
        return {"samples": samples, "hits": 1, "misses": misses, "bytes_downloaded": 10}

    root = tmp_path / "metrics"
    for rank in (0, 1):
        sources = {"web": of(30, 2), "code": of(10 + rank, 1)}
        write_records(root / f"r{rank}.jsonl", [record(rank=rank, world_size=2, sources=sources)])
    write_records(root / "r2.jsonl", [record(rank=1, world_size=2)])  # no sources: fine
    assert main(["report", str(root), "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["jobs"][0]["total"]
    assert total["sources"]["web"] == {
        "samples": 60,
        "hits": 2,
        "misses": 4,
        "shared": 0,
        "from_peers": 0,  # a field added to version 1 counts as 0 in records without it
        "bytes_downloaded": 20,
        "bytes_served": 0,
    }
    assert total["sources"]["code"]["samples"] == 21
    assert main(["report", str(root)]) == 0
    text = capsys.readouterr().out
    assert "by mixture source:" in text and "  web: 60 samples, 2 hits, 4 misses" in text


def test_delivery_checks_and_mismatches_are_reported(tmp_path, capsys) -> None:
    root = tmp_path / "metrics"
    write_records(root / "r0.jsonl", [record(rank=0, world_size=2, delivery_checks=3)])
    write_records(root / "r1.jsonl", [record(rank=1, world_size=2, delivery_checks=2)])
    assert main(["report", str(root)]) == 0
    assert "delivery checks: 5, all matched the plan" in capsys.readouterr().out
    write_records(
        root / "r1b.jsonl",
        [record(rank=1, world_size=2, delivery_checks=1, delivery_mismatches=1)],
    )
    assert main(["report", str(root), "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["jobs"][0]["total"]
    assert (total["delivery_checks"], total["delivery_mismatches"]) == (6, 1)
    assert main(["report", str(root)]) == 0
    text = capsys.readouterr().out
    assert "delivery checks: 6, 1 MISMATCHED the plan" in text
    assert "rank 1 (" in text and "DELIVERY MISMATCHES 1 of 3 checks" in text
