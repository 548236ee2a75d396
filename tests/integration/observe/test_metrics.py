"""Loader metrics: records, periods, the report and its line, the JSON-lines files, and
the counts of a real pipeline (moto S3 behind the fault proxy, DataLoader workers)
against what the server answered and the faults the proxy injected."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
from processes import COLLECTIVE_TIMEOUT, TOGETHER_TIMEOUT, run_together
from torch.utils.data import DataLoader

import shardcache
from shardcache import ConfigError, Settings, ShardCache
from shardcache._observe import metrics
from shardcache._observe.summary import format_job_line, format_line, merge
from shardcache._ops.demo import make_shard
from shardcache._retry.policy import retry_cause

BUCKET = "metrics"
SHARDS = 6
PER_SHARD = 8
pytestmark = pytest.mark.timeout(180)


def _records(directory: Path) -> list[dict]:
    found = []
    for path in sorted(directory.glob("*.jsonl")):
        found += metrics.records_of(path.read_text().splitlines())
    return found


# -- records and periods ---------------------------------------------------------------


def test_records_are_deltas_per_period_and_sum_to_the_epoch() -> None:
    got: list[dict] = []
    remove = shardcache.add_metrics_sink(got.append)
    made = metrics.collector()
    made._interval = 0.0  # every tick closes an interval
    metrics.set_epoch(3)
    made.add(misses=1, bytes_downloaded=100, bytes_served=100)
    metrics.request("HEAD")
    metrics.request("GET")
    made.shard_downloaded("s3://AKIDSECRET:pw@b/a.tar", 2.5, 100)
    metrics.shard_delivered()  # closes interval 1
    made.add(hits=2, bytes_served=200, samples=16)
    metrics.retried(retry_cause(ConnectionResetError()))
    made.lock_wait(0.25, "pid 7 on n1")
    made.lock_wait(0.5, "pid 8 on n2")
    made.waited_for_data(0.1)
    total = metrics.end_epoch()
    remove()
    metrics.shard_delivered()  # after remove(): no sink call
    assert [r["kind"] for r in got] == ["interval", "epoch"]
    first, last = got
    assert first["requests"] == {"HEAD": 1, "GET": 1} and first["shards"] == 1
    assert last["requests"] == {} and last["hits"] == 2 and last["shards"] == 0
    assert last["retries"] == {"reset": 1, "5xx": 0, "slowdown": 0, "truncated": 0, "other": 0}
    assert last["lock_waits"] == {
        "count": 2,
        "seconds": 0.75,
        "worst_s": 0.5,
        "worst_holder": "pid 8 on n2",
    }
    assert first["slowest_shards"] == [{"url": "s3://***@b/a.tar", "seconds": 2.5, "bytes": 100}]
    assert last["start"] == first["start"]  # an epoch record starts at the epoch's start
    assert {r["epoch"] for r in got} == {3} and metrics.collector().epoch == 4
    for r in got:
        assert r["schema"] == "shardcache.metrics" and r["version"] == 1
        assert r["worker"] is None and r["rank"] == 0 and r["pid"] > 0
        assert r["period_s"] == pytest.approx(r["time"] - r["start"], abs=1e-5)
    assert (total["shards"], total["hits"], total["misses"], total["samples"]) == (1, 2, 1, 16)
    assert total["requests"] == {"HEAD": 1, "GET": 1} and total["lock_waits"]["count"] == 2
    assert total["kind"] == "report" and total["epoch"] == 3 and total["processes"] == 1


def test_close_emits_what_is_left_and_nothing_when_nothing_is(caplog) -> None:
    got: list[dict] = []
    shardcache.add_metrics_sink(got.append)
    assert metrics.collector().close() is None
    metrics.count(hits=1, bytes_served=5)
    with caplog.at_level(logging.INFO, logger="shardcache._observe.metrics"):
        record = metrics.collector().close()
    assert record is not None and record["kind"] == "close" and record["hits"] == 1
    assert got == [record]
    assert "shardcache rank 0 epoch 0: 0 samples, 0 shards (1 hits," in caplog.text


def test_a_failing_sink_is_logged_and_the_others_still_get_records(caplog) -> None:
    got: list[dict] = []

    def broken(record: dict) -> None:
        raise RuntimeError("sink down")

    shardcache.add_metrics_sink(broken)
    shardcache.add_metrics_sink(got.append)
    with caplog.at_level(logging.WARNING):
        metrics.end_epoch()
    assert len(got) == 1 and "sink down" in caplog.text
    with pytest.raises(TypeError):
        shardcache.add_metrics_sink("not callable")  # type: ignore[arg-type]


def test_retry_causes() -> None:
    from botocore.exceptions import ClientError

    from shardcache import IntegrityError
    from shardcache._retry.policy import TruncatedBody

    def client_error(status: int, code: str) -> ClientError:
        response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return ClientError(response, "GetObject")

    assert retry_cause(client_error(503, "SlowDown")) == "slowdown"
    assert retry_cause(client_error(500, "InternalError")) == "5xx"
    assert retry_cause(TruncatedBody("cut")) == "truncated"
    assert retry_cause(ConnectionResetError()) == "reset"
    assert retry_cause(TimeoutError()) == "other"
    wrapped = OSError("wrapped")
    wrapped.__cause__ = client_error(502, "BadGateway")
    assert retry_cause(wrapped) == "5xx"
    assert retry_cause(IntegrityError("bad", url="u", attempts=1)) == "integrity"


def test_report_merges_processes_and_formats_one_line() -> None:
    def record(pid: int, start: float, end: float, **counts) -> dict:
        base = merge([])
        base.pop("consumer_s")
        base.pop("processes")
        return base | {
            "kind": "epoch",
            "pid": pid,
            "host": "n1",
            "rank": 3,
            "epoch": 2,
            "start": start,
            "time": end,
            "period_s": end - start,
            **counts,
        }

    a = record(1, 0.0, 60.0, shards=60, samples=6000, hits=59, misses=1, data_wait_s=3.0)
    a["requests"] = {"GET": 2, "HEAD": 1}
    a["verified"] = {"md5": 1}  # b and idle: records of before it, without the field
    a["retries"] = {"reset": 1, "slowdown": 1}
    a["slowest_shards"] = [{"url": "s3://b/x.tar", "seconds": 2.1, "bytes": 10}]
    a["bytes_served"] = 2_100_000_000
    a["lock_waits"] = {"count": 1, "seconds": 0.5, "worst_s": 0.5, "worst_holder": "pid 77 on n2"}
    b = record(2, 0.0, 60.0, shards=60, samples=6000, hits=60, data_wait_s=0.6)
    idle = record(9, 0.0, 61.0)  # the training process, with workers: consumed nothing
    for older in (b, idle):
        del older["verified"]
    report = merge([a, b, idle])
    assert report["verified"] == {"md5": 1}
    assert report["processes"] == 3 and report["consumer_s"] == 120.0
    assert report["data_wait_share"] == pytest.approx(3.6 / 120)
    assert format_line(report) == (
        "shardcache rank 3 epoch 2: 12000 samples, 120 shards (119 hits, 1 misses, 0 shared), "
        "2.1 GB served, 0 B downloaded (verified: md5 1), 2 GETs, 1 HEADs, retries reset 1 / "
        "5xx 0 / SlowDown 1 / truncated 0 / other 0, lock waits 1 (0.5 s, worst 0.5 s on pid "
        "77 on n2), waited for data 3 % of 120 s, stalls 0 warnings / 0 errors, slowest "
        "s3://b/x.tar 2.1 s"
    )
    other = merge([record(5, 0.0, 60.0, shards=10, data_wait_s=30.0)]) | {"rank": 5}
    job = merge([report, other])
    assert job["processes"] == 4 and job["consumer_s"] == 180.0
    line = format_job_line([report, other])
    assert line.startswith("shardcache job epoch 2, 2 ranks: 12000 samples, 130 shards")
    assert line.endswith(
        "most waiting for data: rank 5 50 % (0 retries, 0 stall errors), "
        "rank 3 3 % (2 retries, 0 stall errors)"
    )


# -- settings and files --------------------------------------------------------------------


def test_metrics_settings(tmp_path: Path) -> None:
    s = Settings.resolve({})
    assert s.metrics is None and s.metrics_interval == 30.0
    s = Settings.resolve({"SHARDCACHE_METRICS": str(tmp_path), "SHARDCACHE_METRICS_INTERVAL": "5s"})
    assert s.metrics == str(tmp_path) and s.metrics_interval == 5.0
    assert Settings.resolve({"SHARDCACHE_METRICS": "off"}).metrics is None
    for bad in ("/m/{rank}.jsonl", "/m/{nope}-{pid}", "/m/{pid"):
        with pytest.raises(ConfigError, match="SHARDCACHE_METRICS"):
            Settings.resolve({"SHARDCACHE_METRICS": bad})
    with pytest.raises(ConfigError, match="SHARDCACHE_METRICS_INTERVAL"):
        Settings.resolve({"SHARDCACHE_METRICS_INTERVAL": "soon"})


def test_file_per_process_in_a_directory_or_a_pattern(tmp_path, monkeypatch) -> None:
    record = {"job_id": None, "rank": 2, "worker": 1, "host": "n1", "pid": 42}
    assert metrics.file_for(str(tmp_path), record) == tmp_path / "nojob-r2-w1-n1-42.jsonl"
    pattern = str(tmp_path / "{job}" / "{host}-{pid}.jsonl")
    assert metrics.file_for(pattern, record | {"job_id": "77"}) == tmp_path / "77/n1-42.jsonl"
    out = tmp_path / "out"
    monkeypatch.setenv("SHARDCACHE_METRICS", str(out))
    metrics.count(hits=1)
    metrics.end_epoch()
    (path,) = out.iterdir()
    assert path.name == f"nojob-r0-wmain-{socket.gethostname()}-{os.getpid()}.jsonl"
    assert path.stat().st_mode & 0o777 == 0o600
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["hits"] == 1


# -- the real pipeline ---------------------------------------------------------------------


@pytest.fixture
def dataset(s3) -> dict[str, bytes]:
    objects = {f"train-{i:06d}.tar": make_shard(i, PER_SHARD) for i in range(SHARDS)}
    s3.put_objects(BUCKET, objects)
    return objects


def _loader(endpoint: str, cache_dir: Path, workers: int) -> DataLoader:
    cache = ShardCache(
        cache_dir, storage_options={"endpoint_url": endpoint}, retry_backoff=0.01, retries=4
    )
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"),
        wds.split_by_worker,
        shardcache.tarfile_to_samples(cache=cache, threads=2, depth=2),
        wds.to_tuple("__key__", "cls"),
    )
    return DataLoader(
        pipeline,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=mp.get_context("fork") if workers else None,
        timeout=60 if workers else 0,
    )


def test_counts_of_a_dataloader_run_equal_the_server_and_the_injected_faults(
    s3, fault_proxy, dataset, tmp_path: Path, monkeypatch, caplog
) -> None:
    out = tmp_path / "metrics"
    monkeypatch.setenv("SHARDCACHE_METRICS", str(out))
    monkeypatch.setenv("SHARDCACHE_METRICS_INTERVAL", "1ms")  # interval records too
    faults = {
        "reset": ("reset", "GET", "train-000001"),
        "slowdown": ("status:503", "GET", "train-000002"),
        "truncated": ("truncate", "GET", "train-000003"),
        "5xx": ("status:500", "GET", "train-000004"),
        "slowdown-again": ("status:503", "GET", "train-000005"),
    }
    for kind, method, key in faults.values():
        # Two resets: aiohttp itself sends an idempotent request again once after a reset
        # before the response (unseen by shardcache); the second reset reaches our retries.
        times = 2 if kind == "reset" else 1
        fault_proxy.add_fault(kind, times=times, method=method, path_contains=key)
    loader = _loader(fault_proxy.endpoint_url, tmp_path / "cache", workers=2)
    with caplog.at_level(logging.INFO, logger="shardcache._observe.metrics"):
        keys = [key for key, _cls in loader]
        report = shardcache.log_epoch_summary()
        assert [key for key, _cls in loader] and shardcache.log_epoch_summary()["hits"] == SHARDS
    assert len(keys) == SHARDS * PER_SHARD

    records = _records(out)
    assert {r["kind"] for r in records} >= {"interval", "epoch"}
    assert {r["worker"] for r in records} == {0, 1, None}
    main = merge(r for r in records if r["worker"] is None)  # its epoch records: it read nothing
    assert (main["shards"], main["requests"], main["processes"]) == (0, {}, 1)
    first = [r for r in records if r["epoch"] == 0]
    total = merge(first)
    injected = fault_proxy.stats().injected
    assert len(injected) == len(faults) + 1, injected
    answered_by_proxy = sum(1 for f in injected if f.kind != "truncate")
    hidden = 1  # aiohttp's own resend after the first reset
    # Every attempt shardcache made, counted once; a cold shard is one GET, no HEAD.
    assert s3.count("HEAD", BUCKET) == 0 and set(total["requests"]) == {"GET"}
    assert total["requests"]["GET"] == s3.count("GET", BUCKET) + answered_by_proxy - hidden
    assert total["retries"] == {"reset": 1, "5xx": 1, "slowdown": 2, "truncated": 1, "other": 0}
    assert (total["misses"], total["hits"], total["shared"]) == (SHARDS, 0, 0)
    assert total["shards"] == SHARDS and total["samples"] == SHARDS * PER_SHARD
    assert total["bytes_downloaded"] == sum(len(b) for b in dataset.values())
    assert total["bytes_served"] == total["bytes_downloaded"]
    assert len(total["slowest_shards"]) == 5 and total["integrity_redownloads"] == 0
    # The second epoch: every shard a hit, no request; its records say epoch 1.
    second = merge(r for r in records if r["epoch"] == 1)
    assert (second["hits"], second["misses"], second["requests"]) == (SHARDS, 0, {})
    assert second["samples"] == SHARDS * PER_SHARD
    # The rank's report (the workers' totals handed to the training process) and its line.
    for name in ("samples", "shards", "hits", "misses", "requests", "retries"):
        assert report[name] == total[name], name
    assert report["processes"] == 3 and report["epoch"] == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shardcache rank")]
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        f"shardcache rank 0 epoch 0: {SHARDS * PER_SHARD} samples, {SHARDS} shards "
        f"(0 hits, {SHARDS} misses, 0 shared)"
    )
    assert "retries reset 1 / 5xx 1 / SlowDown 2 / truncated 1 / other 0" in lines[0]
    print(lines[0])
    print(json.dumps(first[0]))


def test_the_stage_in_the_training_process_closes_its_epoch_itself(
    s3, dataset, tmp_path: Path, caplog
) -> None:
    got: list[dict] = []
    shardcache.add_metrics_sink(got.append)
    loader = _loader(s3.endpoint_url, tmp_path / "cache", workers=0)
    with caplog.at_level(logging.INFO, logger="shardcache._observe.metrics"):
        assert len(list(loader)) == SHARDS * PER_SHARD
        report = shardcache.log_epoch_summary(0)  # the same report, no second line
    assert [r["kind"] for r in got] == ["epoch"]
    assert report["misses"] == SHARDS and report["samples"] == SHARDS * PER_SHARD
    assert report["requests"] == {"GET": SHARDS}
    assert caplog.text.count("shardcache rank 0 epoch 0:") == 1


# -- the job's line on rank 0 ---------------------------------------------------------------


def _rank_main(rank: int, store: str, start: Any, results: Any) -> None:
    try:
        start.wait()
        from datetime import timedelta

        import torch.distributed as dist

        lines: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        logging.getLogger("shardcache").addHandler(Keep())
        logging.getLogger("shardcache").setLevel(logging.INFO)
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT),
        )  # fmt: skip
        try:
            made = metrics.collector()
            made.add(shards=3 + rank, samples=(3 + rank) * 8, misses=3 + rank, hits=rank)
            made.waited_for_data(0.001)
            metrics.request("GET")
            if rank == 1:
                metrics.retried(retry_cause(ConnectionResetError()))
            report = shardcache.log_epoch_summary(0)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", (report, lines)))
    except BaseException:
        import traceback

        results.put((rank, "error", traceback.format_exc()))


@pytest.mark.timeout(TOGETHER_TIMEOUT)
def test_rank_zero_logs_the_jobs_line_over_a_gloo_group(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    got = {}
    for rank, status, detail in run_together(_rank_main, [(0, store), (1, store)]):
        assert status == "ok", detail
        got[rank] = detail
    (job, lines0), (own, lines1) = got[0], got[1]
    assert (job["shards"], job["samples"], job["misses"], job["hits"]) == (7, 56, 7, 1)
    assert job["requests"] == {"GET": 2} and job["retries"]["reset"] == 1
    assert job["ranks"] == 2 and job["processes"] == 2 and job["epoch"] == 0
    assert [r["rank"] for r in job["worst_ranks"]] in ([0, 1], [1, 0])
    assert own["rank"] == 1 and own["shards"] == 4  # other ranks get their own report
    job_lines = [line for line in lines0 if line.startswith("shardcache job")]
    assert len(job_lines) == 1 and not [ln for ln in lines1 if ln.startswith("shardcache job")]
    assert job_lines[0].startswith(
        "shardcache job epoch 0, 2 ranks: 56 samples, 7 shards (1 hits, 7 misses, 0 shared)"
    )
    assert [ln for ln in lines0 if ln.startswith("shardcache rank 0 epoch 0: 24 samples")]
    assert [ln for ln in lines1 if ln.startswith("shardcache rank 1 epoch 0: 32 samples")]
    print(job_lines[0])


# -- facts beyond requests: settings in code, lock waits, integrity -------------------------


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_metrics_asked_for_in_code_reach_workers_of_every_start_method(
    s3, dataset, tmp_path: Path, start_method: str
) -> None:
    """``ShardCache(metrics=DIR)`` without the environment variable: the training process
    and its DataLoader workers write their files there, and the workers hand their totals
    to the training process's report, however they were started (a forkserver's worker is
    not the training process's child)."""
    cache = ShardCache(
        tmp_path / "cache",
        storage_options={"endpoint_url": s3.endpoint_url},
        metrics=str(tmp_path / "metrics"),
    )
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"),
        wds.split_by_worker,
        shardcache.tarfile_to_samples(cache=cache),
    )
    loader = DataLoader(
        pipeline,
        batch_size=None,
        num_workers=2,
        multiprocessing_context=mp.get_context(start_method),
    )
    assert len(list(loader)) == SHARDS * PER_SHARD
    report = shardcache.log_epoch_summary(0)
    assert (report["samples"], report["misses"], report["processes"]) == (
        SHARDS * PER_SHARD,
        SHARDS,
        3,
    )
    records = _records(tmp_path / "metrics")
    assert {r["worker"] for r in records} == {0, 1, None}
    assert sum(r["samples"] for r in records) == SHARDS * PER_SHARD


_HOLDER = """
import sys
from shardcache import ShardCache
ShardCache(sys.argv[1], storage_options={"endpoint_url": sys.argv[2]}).fetch(sys.argv[3])
"""


def test_a_lock_wait_is_counted_with_its_holder(s3, fault_proxy, dataset, tmp_path: Path) -> None:
    """Another process downloads a shard (its body held back by the link) while this one
    wants it: one lock wait, naming that process; the shard counts as shared."""
    url = f"s3://{BUCKET}/train-000001.tar"
    held = fault_proxy.add_fault("hold", times=1, method="GET", path_contains="train-000001")
    cache_dir = tmp_path / "cache"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(cache_dir), fault_proxy.endpoint_url, url],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while fault_proxy.stats().faults.get("hold", 0) < 1:  # the holder's GET is held
            assert holder.poll() is None, holder.stderr  # waited for as long as it runs
            time.sleep(0.01)  # polling a condition, bounded by the holder's life
        waiting = threading.Event()

        def progress(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
            if phase.startswith("waiting for pid"):
                waiting.set()

        cache = ShardCache(cache_dir, storage_options={"endpoint_url": fault_proxy.endpoint_url})
        fetched: list[Path] = []
        waiter = threading.Thread(target=lambda: fetched.append(cache.fetch(url, progress)))
        waiter.start()
        assert waiting.wait(60), "the fetch never waited for the holder"
        held.release()
        waiter.join(60)
        assert holder.wait(60) == 0, holder.stderr
    finally:
        held.release()
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)
    assert fetched and fetched[0].read_bytes() == dataset["train-000001.tar"]
    report = shardcache.log_epoch_summary(0)
    assert (report["shared"], report["misses"]) == (1, 0)
    assert report["lock_waits"]["count"] == 1 and report["lock_waits"]["seconds"] > 0
    assert report["lock_waits"]["worst_holder"] == f"pid {holder.pid} on {socket.gethostname()}"
    assert report["requests"] == {}  # the waiter sent nothing: the holder downloaded it


def test_an_integrity_redownload_is_counted(s3, fault_proxy, dataset, tmp_path: Path) -> None:
    """The link flips a byte of one GET's body: the download fails verification and is made
    again, and the report says so (one re-download, two GETs, both seen by the server)."""
    fault_proxy.add_fault("corrupt", times=1, method="GET", path_contains="train-000002")
    cache = ShardCache(
        tmp_path / "cache", storage_options={"endpoint_url": fault_proxy.endpoint_url}
    )
    url = f"s3://{BUCKET}/train-000002.tar"
    assert cache.fetch(url).read_bytes() == dataset["train-000002.tar"]
    report = shardcache.log_epoch_summary(0)
    assert report["integrity_redownloads"] == 1
    assert report["requests"]["GET"] == 2 == s3.count("GET", BUCKET, "train-000002.tar")
    assert sum(report["retries"].values()) == 0  # a re-download, not a retry
