"""A smoke run of the benchmark harness at tiny sizes: well-formed results, no timing checks."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from repo import ROOT

IDS = [f"B{i}" for i in range(1, 12)]
# Peers scripts/bench installs in .venv-bench only: here they must say so, not vanish.
OPTIONAL_PEERS = {
    "s3torchconnector": "s3torchconnector",
    "litdata": "litdata",
    "mosaic": "streaming",
}


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    return []


def assert_the_docs_page_renders(report: dict) -> None:
    """The benchmarks page's generator (bench/docs_tables.py) reads every scenario of a real
    run as the scenario writes it: a row for shardcache and one for every peer."""
    from bench import docs_tables

    summary = docs_tables.summary_region(report)
    for sid, res in report["results"].items():
        assert f"| {sid} |" in summary, sid
        region = docs_tables.scenario_region(report, sid)
        assert "\n| **" in region, (sid, region)  # shardcache's row
        for name in res["peers"]:
            assert f"\n| {name} |" in region, (sid, name, region)


STALL_S = 150  # the longest a tiny scenario may take (about 20 s on an idle machine)


def run_bench_module(module: str, out: Path, *extra: str, stall: float = STALL_S) -> None:
    """``python -m <module> --size tiny --out <out> [extra...]`` from the project root,
    without the caller's AWS_* variables; it must exit 0. The run is bounded by its
    progress, not as a whole: each line it prints (a scenario done) must come within
    ``stall`` seconds of the one before. One bound on the whole run (290 s) was tripped by
    a healthy run on a loaded machine; a hung scenario still fails within ``stall``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--size", "tiny", "--out", str(out), *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    output: list[str] = []
    try:
        while (line := lines.get(timeout=stall)) is not None:
            output.append(line)
        returncode = proc.wait(timeout=stall)
    except (queue.Empty, subprocess.TimeoutExpired):
        pytest.fail(f"{module} made no progress for {stall} s; its output:\n" + "".join(output))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert returncode == 0, "".join(output)[-6000:]


@pytest.mark.timeout(STALL_S * (len(IDS) + 2))  # each scenario, the server ceiling, the start
def test_bench_tiny_produces_well_formed_results(tmp_path: Path) -> None:
    run_bench_module("bench", tmp_path, "--only", ",".join(IDS))  # B13: its own test
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["size"] == "tiny"
    assert report["machine"]["cores"] >= 1 and report["machine"]["versions"]["python"]
    assert report["server_ceiling"]["mb_s"] > 0
    assert set(IDS) <= set(report["results"])
    for sid, res in report["results"].items():
        assert "error" not in res, (sid, res)
        assert res["verdict"] in {"met", "MISSED"}, sid
        assert res["target"] and res["what"], sid
        numbers = _numbers(res["shardcache"])
        assert numbers and all(math.isfinite(n) and n >= 0 for n in numbers), (sid, res)
        assert res["ratio"] is None or res["ratio"] > 0, sid
        assert not res.get("row_errors"), (sid, res["row_errors"])
        for name, peer in res["peers"].items():
            assert "error" not in peer, (sid, name, peer)
            assert _numbers(peer) or peer["status"].startswith("not installed"), (sid, name)
    assert_the_docs_page_renders(report)
    for sid in ("B2", "B3", "B6", "B7"):  # shaped runs report CPU next to the numbers
        assert "machine_cpu_pct" in report["results"][sid]["shardcache"], sid
    assert report["results"]["B3"]["gets_exactly_one_per_shard"] is True
    b8 = report["results"]["B8"]  # every reader of the CPU comparison reports CPU per GB
    assert {"s3fs get", "boto3 download_file"} <= set(b8["peers"])
    measured = [r for r in b8["peers"].values() if "status" not in r]
    assert all(r["cpu_s_per_gb"] > 0 for r in [b8["shardcache"], *measured])
    fast = {"s3fs get (fast server)", "boto3 download_file (fast server)"}
    assert fast <= set(b8["peers"]) and b8["shardcache"]["fast_server_cpu_s_per_gb"] > 0, b8
    assert b8["fast_server_ratio"] > 0, b8
    for s3tc in (
        "s3torchconnector S3Client.get_object",
        "s3torchconnector S3Client.get_object (fast server)",
    ):
        assert ("status" in b8["peers"][s3tc]) == (
            importlib.util.find_spec("s3torchconnector") is None
        )
    _check_equal_concurrency(report["results"]["B2"])
    _check_b6(report["results"]["B6"])
    b7 = report["results"]["B7"]  # waiting for data apart from the per-sample work
    for res in [b7["shardcache"], *b7["peers"].values()]:
        assert res["work_s"] > 0 and res["wait_s"] >= 0, b7
    b9 = report["results"]["B9"]
    assert {"webdataset streaming", "webdataset cache_dir="} <= set(b9["peers"])
    assert all(r["first_sample_s"] > 0 for r in [b9["shardcache"], *b9["peers"].values()])
    table = (tmp_path / "results.md").read_text()
    for sid in IDS:
        assert f"| {sid} |" in table
    b10 = report["results"]["B10"]  # resume: warm, cold, the uninterrupted run, the naive one
    assert b10["shardcache"]["first_batch_s"] > 0 and b10["shardcache"]["finish_s"] > 0
    cold = b10["peers"]["shardcache resume cold (fresh cache, shaped link)"]
    assert cold["first_batch_s"] > 0 and cold["gets"] > 0
    assert b10["peers"]["uninterrupted epoch (warm)"]["samples_s"] > 0
    [naive] = [r for name, r in b10["peers"].items() if name.startswith("naive resume")]
    assert naive["to_resume_point_s"] > 0
    # A ratio of two times: at tiny size the naive skip of a few hundred samples may well
    # beat the workers' start-up, so only its presence is checked, never its size.
    assert b10["speedup_vs_naive"] >= 0 and not b10["row_errors"]
    b11 = report["results"]["B11"]  # bookkeeping: per level, and the maintenance commands
    assert {"miss_ms_100", "hit_ms_300", "status_s", "verify_quick_s", "evict_s"} <= set(
        b11["shardcache"]
    )


def _check_b6(b6: dict) -> None:
    """B6 is judged against min(link, the server's ranged ceiling), from rclone, moto and
    SeaweedFS. Its four kinds of object from SeaweedFS: shardcache verified each by what it
    is, in one GET a part (the whole-object GET gives the first) and, for a multipart
    upload, one HEAD of part 1 for the layout; boto3 with and without its MD5 pass beside
    it, with CPU per GB; the ratios present."""
    from bench.scenarios.b6_large import KIND_READERS, KINDS
    from bench.support.common import SIZES

    assert b6["server_ranged_ceiling"]["mb_s"] > 0 and b6["limit_mb_s"] > 0
    assert b6["moto_ranged_ceiling"]["mb_s"] > 0, b6  # the fast server's and moto's
    assert len(b6["link_fractions"]) == 3 + len(KINDS), b6  # rclone x2, moto, SeaweedFS
    fast = {n.removesuffix(" (fast server)") for n in b6["peers"] if n.endswith("(fast server)")}
    for server, fractions in b6["link_fractions"].items():
        readers = KIND_READERS if server.startswith("SeaweedFS") else {"shardcache", *fast}
        assert set(fractions) == set(readers), b6
    assert b6["peers"]["shardcache (moto)"]["gets"] >= 2, b6  # parts: whole GET + ranged
    size, part, _threshold = SIZES["tiny"]["b6_kinds"]
    parts = -(-size // part)
    for kind, (_key, method) in KINDS.items():
        rows = {n: b6["peers"][f"{n} (SeaweedFS, {kind})"] for n in KIND_READERS}
        sc = rows["shardcache"]
        assert sc["verified"] == method, (kind, sc)
        assert sc["gets"] == parts and sc["heads"] == ("parts" in method), (kind, sc)
        unshaped = {n: b6["peers"][f"{n} (SeaweedFS unshaped, {kind})"] for n in KIND_READERS}
        assert unshaped["shardcache"]["verified"] == method, (kind, unshaped)
        for row in [*rows.values(), *unshaped.values()]:
            assert row["mb_s"] > 0 and row["cpu_s_per_gb"] > 0, (kind, row)
        for how in ("", "_unshaped"):
            ratios = b6[f"kind_ratios{how}"][kind]
            assert len(ratios) == 4 and all(r > 0 for r in ratios.values()), (kind, ratios)
    assert b6["seaweedfs_ranged_ceiling"]["mb_s"] > 0, b6
    for how in ("", "_unshaped"):
        assert set(b6[f"multipart_md5_vs_crc64nvme{how}"]) == {"wall", "cpu"}, b6


def test_md5_pass_checks_a_single_part_and_a_multipart_etag(tmp_path: Path) -> None:
    """The boto3 peer's own MD5 pass (B6) checks the file against the ETag, of the whole
    file or of its parts' MD5s, and refuses a file with one byte changed."""
    import hashlib

    from bench.support.peers import md5_pass

    data = os.urandom(3 * 1000 + 7)
    path = tmp_path / "x.bin"
    path.write_bytes(data)
    parts = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    multipart = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    md5_pass(path, f'"{hashlib.md5(data).hexdigest()}"', 1000)
    md5_pass(path, f'"{multipart}-4"', 1000)
    with pytest.raises(RuntimeError, match="MD5 pass"):
        md5_pass(path, f"{multipart}-4", 999)  # other part boundaries: another checksum
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    for etag in (hashlib.md5(data).hexdigest(), f"{multipart}-4"):
        with pytest.raises(RuntimeError, match="MD5 pass"):
            md5_pass(path, etag, 1000)


def _check_equal_concurrency(b2: dict) -> None:
    """Every peer ran (or says it is not installed) and every reader yielded every sample."""
    rows = b2["peers"]
    ran = {
        "shardcache threads=1",
        "webdataset streaming",
        "webdataset cache_dir=",
        "s3fs get",
        "boto3 download_file",
    }
    for prefix in ran:
        [row] = [r for name, r in rows.items() if name.startswith(prefix)]
        assert row["samples_s"] > 0, (prefix, row)
    for peer, module in OPTIONAL_PEERS.items():
        found = [r for name, r in rows.items() if name.startswith(peer)]
        assert found, (peer, list(rows))
        if importlib.util.find_spec(module) is None:
            assert all(r["status"].startswith("not installed") for r in found), (peer, found)
        else:
            assert all(r["samples_s"] > 0 for r in found), (peer, found)


@pytest.mark.timeout(120)
def test_at_scale_simulation_runs_the_planning_code_at_tiny_size(capsys) -> None:
    """bench/studies/at_scale.py at 4 nodes: every table printed, the split covers every shard
    once (the first epoch downloads each shard once in every scope), no time checked."""
    from bench.studies import at_scale

    assert at_scale.main(["--nodes", "4", "--shards", "96", "--seconds", "15", "--scale", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("| WebDataset split (fixed) |") == 6
    assert "| WebDataset split (fixed) | node | 1 | 96 | 6,144 |" in out  # 64 GETs a shard
    for scope in ("rank", "node", "shared"):  # each rank keeps its shards: epoch 2 is cached
        assert f"| ResumableDataset (stable split) | {scope} | 2 | 0 |" in out
    for row in ("backoff per request", "shared throttle per process", "MAX_REQUEST_RATE="):
        assert row in out, row


@pytest.mark.timeout(300)
def test_b12_node_lock_tiny_counts_operations_with_and_without(tmp_path: Path) -> None:
    """B12 (bench/scenarios/b12_node_lock.py, its own script: it mounts JuiceFS) at tiny size."""
    from mounts import require_fuse

    from bench import docs_tables

    require_fuse()
    out, full = tmp_path / "b12.json", tmp_path / "full"
    full.mkdir()
    base = json.loads((ROOT / "bench" / "results.json").read_text()) | {"size": "tiny"}
    (full / "results.json").write_text(json.dumps(base))
    run_bench_module("bench.scenarios.b12_node_lock", out, "--merge", "--into", str(full))
    result = json.loads(out.read_text())
    for run in ("with node lock", "without node lock"):
        res = result[run]
        assert res["gets_exactly_one_per_shard"] is True and res["misses"] == 3, (run, res)
        assert res["fuse_ops_per_shard"] > 0 and res["meta_ops_per_shard"] > 0, (run, res)
        assert res["by_kind"]["meta_ops:Link"] >= 1, (run, res)  # the lease was taken
    # --merge: the same figures as B12 of the full run's file, the other scenarios untouched
    merged = json.loads((full / "results.json").read_text())
    assert merged["results"].pop("B12")["shardcache"] == result["with node lock"]
    base["results"].pop("B12", None)  # the stored run's own B12, if it has one, was replaced
    assert merged == base
    assert "| B12 |" in (full / "results.md").read_text()
    merged["results"]["B12"] = json.loads((full / "results.json").read_text())["results"]["B12"]
    assert "| **with the node lock** |" in docs_tables.scenario_region(merged, "B12")


@pytest.mark.timeout(200)
def test_b13_epochs_tiny_counts_requests_per_epoch(tmp_path: Path) -> None:
    """B13 at tiny size: a row per reader x scope, 3 epochs each, with
    GETs, bytes, samples and the order change; shardcache's later epochs make no GET. Peers
    not installed here (Mosaic) say so; nothing is timed."""
    from bench.scenarios.b13_epochs import EPOCHS, READERS, SIZES, row_name
    from bench.support.infra import samples_per_shard

    run_bench_module("bench", tmp_path, "--only", "B13")
    report = json.loads((tmp_path / "results.json").read_text())
    res = report["results"]["B13"]
    assert "error" not in res and not res["row_errors"], res.get("row_errors", res)
    assert res["verdict"] == "met" and res["target"] and res["what"], res
    assert "| B13 |" in (tmp_path / "results.md").read_text()
    assert_the_docs_page_renders(report)
    cfg = SIZES["tiny"]
    total = cfg["shards"] * samples_per_shard(cfg["shard_bytes"], cfg["sample"])
    mosaic = importlib.util.find_spec("streaming") is not None
    for name, kind, scope, _options in READERS:
        key = row_name(name, scope)
        rows = [r for r in res["rows"] if r["reader"] == key]
        if kind == "mosaic" and not mosaic:
            assert not rows and res["peers"][key]["status"].startswith("not installed"), key
            continue
        assert [r["epoch"] for r in rows] == list(range(EPOCHS)), (key, rows)
        for row in rows:
            assert row["gets"] >= 0 and row["bytes"] >= 0 and row["other_requests"] >= 0, row
            assert row["distinct"] == total and row["samples"] >= total, row
            assert (row["order_changed"] is None) == (row["epoch"] == 0), row
        assert rows[0]["gets"] > 0 and rows[0]["bytes"] > 0, rows  # the first epoch downloads
        summary = res["shardcache"] if key == row_name("shardcache", "rank") else res["peers"][key]
        assert summary["gets_total"] == sum(r["gets"] for r in rows), (key, summary)
    for scope in ("rank", "node"):  # each cache keeps its shards: later epochs are cached
        rows = [r for r in res["rows"] if r["reader"] == row_name("shardcache", scope)]
        assert [r["gets"] for r in rows[1:]] == [0] * (EPOCHS - 1), rows
        assert rows[0]["gets"] <= cfg["shards"] + 1, rows
    learned = [r for r in res["rows"] if r["reader"].startswith("shardcache, index learned")]
    # The ranks learn the index together: each shard fetched once across the job, plus at
    # most one for each cache evening out its samples.
    assert learned[0]["gets"] <= cfg["shards"] + 2, learned
    assert res["peers"][row_name("mosaic streaming", "rank")]["status"].startswith("not applicable")


@pytest.mark.timeout(120)
def test_b14_mixture_tiny_reports_both_readers_and_their_ratio(tmp_path: Path) -> None:
    """B14 at tiny size: the mixture and the one source over the same
    shards, each every sample once an epoch (checked by the scenario: else row_errors), a
    row in the table; nothing is timed."""
    from bench.scenarios.b14_mixture import ONE, SIZES

    run_bench_module("bench", tmp_path, "--only", "B14")
    report = json.loads((tmp_path / "results.json").read_text())
    res = report["results"]["B14"]
    assert "error" not in res and not res["row_errors"], res.get("row_errors", res)
    assert res["verdict"] in {"met", "MISSED"} and res["target"] and res["what"], res
    assert set(res["peers"]) == {ONE}, res["peers"]
    for row in (res["shardcache"], res["peers"][ONE]):
        assert row["samples_s"] > 0 and row["wall_s"] > 0 and row["cpu_us_per_sample"] >= 0, row
    assert len(res["ratios"]) == SIZES["tiny"]["reps"] and res["ratio"] > 0, res
    assert res["cpu_ratio"] > 0 and math.isfinite(res["mixing_cpu_us_per_sample"]), res
    with_workers = res["workers"]["cpu_us_per_sample"]
    assert set(with_workers) == {ONE, "mixture", "mixture, prepared"}, res["workers"]
    assert set(res["verdicts"]) == {"mixing", "workers"}, res
    assert len(res["workers"]["workers_mixing_cpu_pct_runs"]) == SIZES["tiny"]["reps"], res
    assert all(v > 0 for v in with_workers.values()), res["workers"]
    assert "| B14 |" in (tmp_path / "results.md").read_text()
    assert_the_docs_page_renders(report)


@pytest.mark.timeout(120)
def test_b16_stage_check_tiny_reports_both_readers_on_both_kinds(tmp_path: Path) -> None:
    """B16 at tiny size: stage() + webdataset's tar reader and
    webdataset over the cached files, on .tar and .tar.gz shards, each delivering the same
    samples and bytes (checked by the scenario: else row_errors), a ratio and the extra CPU
    for each case, a row in the table; nothing is timed."""
    from bench.scenarios.b16_stage_check import KINDS, SIZES, STAGE, WDS, _name

    run_bench_module("bench", tmp_path, "--only", "B16")
    report = json.loads((tmp_path / "results.json").read_text())
    res = report["results"]["B16"]
    assert "error" not in res and not res["row_errors"], res.get("row_errors", res)
    assert res["target"] and res["what"] and res["verdict"] == "reported", res
    cfg = SIZES["tiny"]
    names = {_name(r, k, s) for r in (STAGE, WDS) for k in KINDS for s in cfg["samples"]}
    first = _name(STAGE, next(iter(KINDS)), next(iter(cfg["samples"])))
    assert res["label"] == first and set(res["peers"]) == names - {first}, res
    for row in (res["shardcache"], *res["peers"].values()):
        assert row["cpu_us_per_sample"] > 0 and row["samples_s"] > 0, row
        assert row["reps"] == cfg["reps"], row
    assert len(res["cpu_ratios"]) == len(KINDS) * len(cfg["samples"]), res
    assert all(r > 0 for r in res["cpu_ratios"].values()), res
    assert res["cpu_ratios"].keys() == res["extra_cpu_us"].keys(), res
    assert all(math.isfinite(v) for v in res["extra_cpu_us"].values()), res
    assert res["ratio"] == next(iter(res["cpu_ratios"].values())), res
    assert "| B16 |" in (tmp_path / "results.md").read_text()
    assert_the_docs_page_renders(report)


def test_b13_shuffle_quality_places_the_split_between_its_bounds(capsys) -> None:
    """bench/studies/shuffle_quality.py at a small size: Mosaic's entropy measure over the library's
    own split and shuffle buffer; no shuffle is 0 of the way to a global shuffle, a global
    shuffle all of it, and a rank keeps its samples across epochs at rank scope."""
    from bench.studies import shuffle_quality

    argv = ["--shards", "40", "--samples", "10", "--ranks", "4", "--nodes", "2"]
    argv += ["--workers", "2", "--batch", "4", "--buffers", "0", "20", "--epochs", "2"]
    report = shuffle_quality.run(shuffle_quality.main_parser().parse_args(argv))
    results = report["results"]
    none = results["no shuffle (shuffle_shards=False, no buffer)"]
    full = results["global shuffle (uniform permutation)"]
    assert none["of_global"] == 0 and full["of_global"] == 1, results
    assert full["entropy_bits"] > none["entropy_bits"] > 0, results
    buffered = results["shardcache rank scope, shuffle_buffer=20"]
    assert none["entropy_bits"] < buffered["entropy_bits"] <= full["entropy_bits"] * 1.05
    assert buffered["same_rank_pct"] == 100 and full["same_rank_pct"] < 100, results
    for res in results.values():
        assert 1 <= res["shards_per_global_batch"] <= 16, res
    assert shuffle_quality.main(argv) == 0
    assert "| global shuffle (uniform permutation) |" in capsys.readouterr().out


def test_elastic_moves_reports_each_case_against_its_references(capsys) -> None:
    """bench/studies/elastic_moves.py on its small cases: the library's hand-out moves about the
    least a change can move (plus about two shards a cache evening out shards this
    unequal) and far fewer shards than contiguous spans."""
    from bench.studies import elastic_moves

    argv = ["--max-shards", "2000"]
    rows = elastic_moves.run(elastic_moves.main_parser().parse_args(argv))
    assert [(r["before"], r["after"]) for r in rows] == [(8, 7), (8, 9), (16, 12)]
    for row in rows:
        assert row["moved"] <= row["at_least"] + 2 * max(row["before"], row["after"]), row
        assert row["moved"] < row["contiguous"] / 2, row
        assert 1 <= row["reads_per_shard"] < 1.05, row
    assert elastic_moves.main(argv) == 0
    assert "| 2,000 | 8 -> 7 |" in capsys.readouterr().out


def test_index_reads_finds_the_same_offsets_every_way(capsys) -> None:
    """bench/studies/index_reads.py on one small shard: whole, header-by-header and windowed
    reads find the same offsets (it checks), one GET against one per tar member."""
    from bench.studies import index_reads

    rows = index_reads.run(index_reads.main_parser().parse_args(["--shard-mb=1", "--sample-kb=64"]))
    (row,) = rows
    assert row["whole"]["gets"] == 1
    assert row["headers"]["gets"] == 2 * row["samples"] + 1  # two members a sample, the end
    assert row["whole"]["bytes"] == row["shard_bytes"] > row["headers"]["bytes"]
    assert index_reads.main(["--shard-mb=1", "--sample-kb=64"]) == 0
    assert "| whole | 1 |" in capsys.readouterr().out


def test_a_study_keeps_its_counts_and_drops_its_timings() -> None:
    """bench.studies runs a study (index-reads, one small shard) into the record the
    benchmarks page renders: the GETs and bytes kept, moto's times left out."""
    from bench import docs_tables, studies

    record = studies.measure("index-reads", ["--shard-mb=1", "--sample-kb=64"])
    (row,) = record["figures"]
    assert row["whole"]["gets"] == 1 and row["headers"]["gets"] == 2 * row["samples"] + 1
    assert all("seconds" not in row[way] for way in ("whole", "headers", "windows")), row
    assert record["setup"] == {"shard_mb": 1, "sample_kb": [64]}
    page = docs_tables.region({"studies": {"index-reads": record}}, "index-reads")
    assert "| whole | 1 |" in page and "| moto s |" not in page and "model s" in page, page


@pytest.mark.timeout(STALL_S * 12)  # a hang bound: each of its ~9 rows prints when done
def test_b15_fast_server_tiny_reports_every_reader_or_why_not(tmp_path: Path) -> None:
    """B15 (rclone serve s3) at tiny size: every row measured with
    MB/s and CPU per GB, or a status saying why not (a peer or curl not installed, a hang);
    the ratios and per-target verdicts present; nothing is timed."""
    import shutil

    from bench.scenarios.b15_fast_server import SIZES, _rows

    run_bench_module("bench", tmp_path, "--only", "B15")
    report = json.loads((tmp_path / "results.json").read_text())
    res = report["results"]["B15"]
    assert "error" not in res and not res["row_errors"], res.get("row_errors", res)
    assert res["verdict"] in {"met", "MISSED"} and res["target"] and res["what"], res
    cfg = SIZES["tiny"]
    rows = _rows(cfg["inflight"], cfg["size"])
    assert set(res["peers"]) == set(rows) - {"shardcache"}, res["peers"]
    for name, row in [("shardcache", res["shardcache"]), *res["peers"].items()]:
        kind = rows[name][0]
        if "status" in row:
            assert kind != "shardcache" and row["status"].startswith(("not installed", "hangs"))
            continue
        assert row["mb_s"] > 0 and row["cpu_s_per_gb"] > 0 and row["reps"] == cfg["reps"], row
        assert len(row["mb_s_runs"]) == cfg["reps"] and "server_cpu_pct" in row, row
    missing = {
        "curl": shutil.which("curl") is None,
        "s3torchconnector": importlib.util.find_spec("s3torchconnector") is None,
    }
    for name, row in res["peers"].items():
        kind = rows[name][0]
        if missing.get(kind):
            assert row["status"].startswith("not installed"), (name, row)
    assert res["best_peer"] in res["peers"] and res["ratio"] > 0 and res["cpu_ratio"] > 0, res
    assert set(res["verdicts"]) == {"throughput", "cpu", "curl"}, res
    assert (res["curl_ratio"] is None) == missing["curl"], res
    assert "| B15 |" in (tmp_path / "results.md").read_text()


@pytest.mark.timeout(120)
def test_merge_replaces_only_the_scenario_run_and_says_when(tmp_path: Path) -> None:
    """``python -m bench --only B4 --merge`` into a copy of the full run's results: B4 is measured
    afresh and stamped with when and at what load; every other scenario and the run's own
    fields stay as they were, so the benchmarks page keeps the full run's figures."""
    from bench import docs_tables

    base = json.loads((ROOT / "bench" / "results.json").read_text()) | {"size": "tiny"}
    (tmp_path / "results.json").write_text(json.dumps(base))
    run_bench_module("bench", tmp_path, "--only", "B4", "--merge")
    merged = json.loads((tmp_path / "results.json").read_text())
    assert list(merged["results"]) == list(base["results"])
    assert {k: v for k, v in merged.items() if k != "results"} == {
        k: v for k, v in base.items() if k != "results"
    }
    for sid, res in base["results"].items():
        if sid != "B4":
            assert merged["results"][sid] == res, sid
    b4 = merged["results"]["B4"]
    assert b4["measured"]["started"] > base["started"] and b4["measured"]["load_avg"] >= 0, b4
    assert b4["shardcache"] != base["results"]["B4"]["shardcache"]
    assert "B4 (measured alone on " in docs_tables.run_region(merged)
    assert "| B4 |" in (tmp_path / "results.md").read_text()
