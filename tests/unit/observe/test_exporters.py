"""The exporters of "shardcache.metrics" records: PrometheusSink (a real scrape over
loopback, parsed by prometheus_client's own parser; the node_exporter textfile) and
TensorBoardSink (a real SummaryWriter, read back with TensorBoard's EventAccumulator)."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from metrics_records import T0, record

from shardcache import MissingExtraError, PrometheusSink, TensorBoardSink


def _job_records() -> list[dict]:
    """Rank 3's main process (two intervals, then its epoch record, whose start is the
    epoch's) and one DataLoader worker, in time order."""
    base = {"rank": 3, "host": "scnode2", "job_id": "77", "world_size": 4}
    worker = record(
        **base,
        pid=2,
        worker=0,
        start=T0,
        time=T0 + 10,
        samples=300,
        shards=3,
        hits=2,
        misses=1,
        bytes_downloaded=1000,
        bytes_served=3000,
        requests={"HEAD": 1, "GET": 2, "WEIRD": 5},
        verified={"md5-parts": 2, "size": 1, "s3://b/not-a-method": 4},
        retries={"5xx": 1, "reset": 0, "a-new-cause": 2},
        lock_waits={"count": 1, "seconds": 0.5, "worst_s": 0.5, "worst_holder": "pid 9 on x"},
        slowest_shards=[{"url": "s3://b/k.tar", "seconds": 2.0, "bytes": 1000}],
    )
    del worker["data_wait_s"], worker["data_wait_share"]  # measured in the main process
    return [
        record(**base, pid=1, start=T0, time=T0 + 10, data_wait_s=2.0, samples=0),
        worker,
        record(**base, pid=1, start=T0 + 10, time=T0 + 20, data_wait_s=1.0),
        # the epoch's remainder: counts since T0 + 20, but start is the epoch's start
        record(**base, pid=1, kind="epoch", start=T0, time=T0 + 25, data_wait_s=2.5),
    ]


# ------------------------------------------------------------------------- Prometheus


def _parse(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def _labels(worker: str = "main", **extra: str) -> frozenset:
    base = {"job_id": "77", "host": "scnode2", "rank": "3", "worker": worker}
    return frozenset({**base, **extra}.items())


def _check_values(values: dict[tuple[str, frozenset], float]) -> None:
    w0 = _labels("0")
    assert values[("shardcache_samples_total", w0)] == 300
    assert values[("shardcache_fetches_total", _labels("0", result="hit"))] == 2
    assert values[("shardcache_fetches_total", _labels("0", result="miss"))] == 1
    assert values[("shardcache_downloaded_bytes_total", w0)] == 1000
    assert values[("shardcache_requests_total", _labels("0", method="GET"))] == 2
    # bounded label values: an unknown method or cause is "other"
    assert values[("shardcache_requests_total", _labels("0", method="other"))] == 5
    assert values[("shardcache_retries_total", _labels("0", cause="5xx"))] == 1
    verified = "shardcache_shards_verified_total"
    assert values[(verified, _labels("0", method="md5-parts"))] == 2
    assert values[(verified, _labels("0", method="size"))] == 1
    assert values[(verified, _labels("0", method="other"))] == 4  # never a label of its own
    assert (verified, _labels(method="size")) not in values  # records without it count none
    assert values[("shardcache_retries_total", _labels("0", cause="other"))] == 2
    assert values[("shardcache_lock_wait_seconds_total", w0)] == 0.5
    main = _labels()
    assert values[("shardcache_data_wait_seconds_total", main)] == 5.5
    # 25 s covered, not 10 + 10 + 25: the epoch record covers only T0+20..T0+25
    assert values[("shardcache_recorded_seconds_total", main)] == 25
    assert values[("shardcache_data_wait_share", main)] == pytest.approx(2.5 / 5)
    assert values[("shardcache_last_record_timestamp_seconds", main)] == T0 + 25
    assert not any("s3://" in str(labels) for _name, labels in values)


def test_prometheus_endpoint_is_scraped_over_loopback(caplog) -> None:
    with PrometheusSink(port=0) as sink:
        assert sink.port and sink.url == f"http://127.0.0.1:{sink.port}/metrics"
        for rec in _job_records():
            sink(rec)
        sink({"schema": "something.else", "version": 9})  # ignored
        sink(record(version=2, rank=3, samples=10**6))  # ignored, logged once
        with urllib.request.urlopen(sink.url, timeout=30) as response:
            assert response.status == 200
            text = response.read().decode()
        _check_values(_parse(text))
        assert "version 2" in caplog.text
    # closed: nothing listens on the port any more
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(sink.url, timeout=30)


def test_prometheus_sinks_have_their_own_registries() -> None:
    from prometheus_client import REGISTRY

    first, second = PrometheusSink(), PrometheusSink()
    first(_job_records()[1])
    assert first.registry is not second.registry is not REGISTRY
    assert REGISTRY.get_sample_value("shardcache_samples_total") is None
    labels = dict(_labels("0"))
    assert first.registry.get_sample_value("shardcache_samples_total", labels) == 300
    assert second.registry.get_sample_value("shardcache_samples_total", labels) is None


def test_prometheus_textfile_is_replaced_atomically(tmp_path) -> None:
    path = tmp_path / "shardcache.prom"
    sink = PrometheusSink(textfile=path)
    assert path.exists()  # written at once: node_exporter sees the sink from the start
    for rec in _job_records():
        sink(rec)
    _check_values(_parse(path.read_text()))
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    sink.close()
    assert [p.name for p in tmp_path.iterdir()] == ["shardcache.prom"]  # no temp file left


def test_prometheus_sink_ignores_records_in_a_forked_worker(tmp_path) -> None:
    sink = PrometheusSink(textfile=tmp_path / "m.prom")
    before = (tmp_path / "m.prom").read_text()
    pid = os.fork()
    if pid == 0:  # the child: as a DataLoader worker holding an inherited sink
        code = 0
        try:
            sink(_job_records()[1])
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "m.prom").read_text() == before


def test_prometheus_missing_extra_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'shardcache\[prometheus\]'") as info:
        PrometheusSink()
    assert info.value.extra == "prometheus"
    assert isinstance(info.value, ImportError)


# ------------------------------------------------------------------------ TensorBoard


def _read_scalars(logdir: Path) -> dict[str, list[tuple[float, int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {
        tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


@pytest.fixture
def summary_writer(tmp_path):
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    writer = tensorboard.SummaryWriter(str(tmp_path / "runs"))
    yield writer
    writer.close()


def test_tensorboard_scalars_read_back(summary_writer, tmp_path) -> None:
    sink = TensorBoardSink(summary_writer)
    for rec in _job_records():
        sink(rec)
    sink({"schema": "shardcache.metrics", "version": 2, "time": T0})  # ignored
    summary_writer.flush()
    scalars = _read_scalars(tmp_path / "runs")
    share = scalars["shardcache/data_wait_share"]
    # the main process: steps 0, 1, 2; walltime = the record's time; the epoch record's
    # share over the 5 s it covers, not the 25 s since the epoch's start
    assert [(t, s) for t, s, _v in share] == [(T0 + 10, 0), (T0 + 20, 1), (T0 + 25, 2)]
    assert [v for _t, _s, v in share] == pytest.approx([0.2, 0.1, 0.5])
    worker = "shardcache/worker0/"
    assert scalars[worker + "samples_per_s"] == [(T0 + 10, 0, pytest.approx(30.0))]
    assert scalars[worker + "hit_rate"][0][2] == pytest.approx(2 / 3)
    assert scalars[worker + "retries"][0][2] == 3
    assert scalars[worker + "gets"][0][2] == 2
    assert scalars[worker + "bytes_downloaded"][0][2] == 1000
    assert scalars[worker + "lock_wait_s"][0][2] == 0.5
    assert scalars[worker + "verified_md5-parts"][0][2] == 2
    assert scalars[worker + "verified_size"][0][2] == 1
    assert scalars[worker + "verified_other"][0][2] == 4
    assert "shardcache/verified_size" not in scalars  # the main process downloaded none
    assert worker + "data_wait_share" not in scalars  # the worker record carries none


def test_tensorboard_step_from_the_training_loop(summary_writer, tmp_path) -> None:
    steps = iter([100, 250, 400, 550])
    sink = TensorBoardSink(summary_writer, prefix="data/", step=lambda: next(steps))
    for rec in _job_records():
        sink(rec)
    summary_writer.flush()
    scalars = _read_scalars(tmp_path / "runs")
    assert [s for _t, s, _v in scalars["data/data_wait_share"]] == [100, 400, 550]
    assert [s for _t, s, _v in scalars["data/worker0/samples_per_s"]] == [250]


def test_tensorboard_sink_needs_a_writer() -> None:
    with pytest.raises(TypeError, match="SummaryWriter"):
        TensorBoardSink(object())


def test_prometheus_counts_per_mixture_source() -> None:
    sources = {
        "web": {"samples": 40, "hits": 3, "misses": 1, "shared": 0, "bytes_downloaded": 500},
        "code": {"samples": 20, "hits": 0, "misses": 2, "shared": 1, "bytes_downloaded": 900},
        "bad": "not counts",  # tolerated: left out
    }
    with PrometheusSink() as sink:
        sink(record(rank=3, host="scnode2", job_id="77", samples=60, sources=sources))
        from prometheus_client import generate_latest

        values = _parse(generate_latest(sink.registry).decode())
    assert values[("shardcache_source_samples_total", _labels(source="web"))] == 40
    assert values[("shardcache_source_samples_total", _labels(source="code"))] == 20
    hit, miss = _labels(source="web", result="hit"), _labels(source="code", result="miss")
    assert values[("shardcache_source_fetches_total", hit)] == 3
    assert values[("shardcache_source_fetches_total", miss)] == 2
    assert values[("shardcache_source_downloaded_bytes_total", _labels(source="code"))] == 900
    assert not any(("source", "bad") in labels for _name, labels in values)


def test_every_method_a_download_is_verified_by_has_a_label_of_its_own() -> None:
    """The sinks' fixed set of methods covers every checksum a download can be checked by
    (S3's algorithms and the ETag's MD5, of the bytes or of a multipart upload's parts)."""
    from shardcache._observe.metric_records import VERIFIED_METHODS
    from shardcache._store.publish import SIZE_ONLY
    from shardcache._transfer.checksums import S3_ALGORITHMS, Checksum

    # Every algorithm S3 names, whether or not this awscrt computes the xxHashes.
    algorithms = {*S3_ALGORITHMS, "xxhash3", "xxhash64", "xxhash128", "md5"}
    methods = {Checksum(a, "v", "test").method for a in algorithms}
    methods |= {
        Checksum(a, "v", "test", parts=2).method
        for a in algorithms
        if a != "crc64nvme"  # S3 keeps CRC64NVME of the full object only
    }
    assert methods | {SIZE_ONLY} == set(VERIFIED_METHODS)


def test_prometheus_counts_delivery_checks_and_mismatches() -> None:
    from prometheus_client import generate_latest

    base = {"rank": 3, "host": "scnode2", "job_id": "77"}
    with PrometheusSink() as sink:
        sink(record(**base, delivery_checks=2))
        sink(record(**base, delivery_checks=1, delivery_mismatches=1))
        values = _parse(generate_latest(sink.registry).decode())
    assert values[("shardcache_delivery_checks_total", _labels())] == 3
    assert values[("shardcache_delivery_mismatches_total", _labels())] == 1
