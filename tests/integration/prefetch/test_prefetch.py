"""Prefetcher: order, depth bound, laziness, cancellation, errors, watchdog, starvation.

Unit tests inject a fake ``fetch`` (gated by Events, reporting progress like a download,
so a closed prefetcher cancels it) and a fake clock; integration tests run ``ShardCache``
against the moto S3 server and the fault proxy. Every wait is bounded.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import os
import pickle
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from threads import PrefetchThreads

from shardcache import (
    ConfigError,
    FetchError,
    IntegrityError,
    RemoteNotFoundError,
    ShardCache,
    StallError,
    UrlError,
    log_epoch_summary,
)
from shardcache._disk.layout import is_temp_name
from shardcache._prefetch.prefetcher import THREAD_NAME_PREFIX, PrefetchedShard, Prefetcher

BUCKET = "prefetch"
WAIT = 10.0  # bound of every wait on a test event
pytestmark = pytest.mark.timeout(60)


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if is_temp_name(p.name)]


@pytest.fixture(autouse=True)
def no_leaked_prefetch_threads(prefetch_threads: PrefetchThreads) -> Iterator[None]:
    yield
    prefetch_threads.assert_ended()


class FakeClock:
    """A monotonic clock that moves only when told to (deterministic time shares)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = 1000.0

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


class FakeFetch:
    """A fetch double writing ``size`` bytes to ``root/<last url segment>``, reporting
    progress per chunk like ShardCache.

    ``gated``: each fetch holds until ``open(url)``, reporting progress meanwhile (so it
    honours cancellation) and failing after ``WAIT``. ``errors``: url -> exception to raise.
    With ``clock``, each fetch advances it by ``seconds`` (simulated download time).
    """

    def __init__(
        self,
        root: Path,
        *,
        gated: bool = False,
        errors: dict[str, BaseException] | None = None,
        size: int = 4096,
        clock: FakeClock | None = None,
        seconds: float = 0.0,
    ) -> None:
        self.root = root
        self.gated = gated
        self.errors = errors or {}
        self.size = size
        self.clock = clock
        self.seconds = seconds
        self.cond = threading.Condition()
        self.calls: Counter[str] = Counter()
        self.started: list[str] = []
        self.finished: list[str] = []
        self.opened: set[str] = set()
        self.ended: dict[str, str] = {}  # url -> name of the exception that ended its fetch
        self.active = 0  # fetches started and not yet received by the consumer
        self.max_active = 0

    def open(self, url: str) -> None:
        with self.cond:
            self.opened.add(url)
            self.cond.notify_all()

    def consumed(self) -> None:
        with self.cond:
            self.active -= 1

    def wait_until(self, predicate: Callable[[], bool]) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout=WAIT), "fake fetch: condition not met"

    def _wait_for_gate(self, url: str, progress) -> None:
        deadline = time.monotonic() + WAIT
        with self.cond:
            # Wake every 10 ms to report (unchanged) progress, as a slow download does.
            while url not in self.opened:
                assert time.monotonic() < deadline, f"test gate of {url} never opened"
                self.cond.wait(0.01)
                progress(phase="downloading", bytes_done=0, bytes_total=self.size)

    def __call__(self, url: str, progress) -> Path:
        with self.cond:
            self.calls[url] += 1
            self.started.append(url)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.cond.notify_all()
        progress(phase="downloading", bytes_done=0, bytes_total=self.size)
        if self.gated:
            try:
                self._wait_for_gate(url, progress)
            except BaseException as exc:
                with self.cond:
                    self.ended[url] = type(exc).__name__
                    self.cond.notify_all()
                raise
        if self.clock is not None:
            self.clock.advance(self.seconds)
        if url in self.errors:
            raise self.errors[url]
        path = self.root / url.rsplit("/", 1)[-1]
        with path.open("wb") as out:
            for done in range(0, self.size, 1024):
                chunk = min(1024, self.size - done)
                out.write(b"x" * chunk)
                progress(phase="downloading", bytes_done=done + chunk, bytes_total=self.size)
        with self.cond:
            self.finished.append(url)
            self.cond.notify_all()
        return path


def _write_shard(root: Path, url: str, progress) -> Path:
    """A picklable fetch: writes the shard at once."""
    path = root / url.rsplit("/", 1)[-1]
    path.write_bytes(url.encode())
    progress(phase="downloading", bytes_done=len(url), bytes_total=len(url))
    return path


class Consumer(threading.Thread):
    """Iterates ``shards`` in a thread; ``result()`` joins (bounded) and re-raises."""

    def __init__(self, shards: Prefetcher, on_item: Callable[[], None] = lambda: None) -> None:
        super().__init__(name="test-consumer", daemon=True)
        self.shards = shards
        self.on_item = on_item
        self.items: list[PrefetchedShard] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for shard in self.shards:
                self.items.append(shard)
                self.on_item()
        except BaseException as exc:
            self.error = exc

    def result(self) -> list[PrefetchedShard]:
        self.join(WAIT)
        assert not self.is_alive(), "consumer still running"
        if self.error is not None:
            raise self.error
        return self.items


def _urls(n: int) -> list[str]:
    return [f"mem://shards/s-{i:03d}" for i in range(n)]


# -- unit tests with a fake fetch ------------------------------------------------------


def test_yields_in_input_order_when_later_shards_finish_first(tmp_path: Path) -> None:
    urls = _urls(12)
    fake = FakeFetch(tmp_path, gated=True)
    consumer = Consumer(Prefetcher(fake, urls, threads=4, depth=4, stall_timeout=60))
    consumer.start()
    for block in range(0, len(urls), 4):
        for url in reversed(urls[block : block + 4]):  # finish each block back to front
            fake.wait_until(lambda u=url: u in fake.started)
            fake.open(url)
            fake.wait_until(lambda u=url: u in fake.finished)
    items = consumer.result()
    assert [s.url for s in items] == urls
    assert all(s.path == tmp_path / u.rsplit("/", 1)[-1] for s, u in zip(items, urls, strict=True))
    assert fake.finished[:4] == urls[3::-1], "later shards really finished first"
    assert set(fake.calls.values()) == {1} and len(fake.calls) == len(urls)


@pytest.mark.parametrize(("threads", "depth", "seed"), [(2, 5, 0), (3, 3, 1), (6, 2, 2)])
def test_never_more_than_depth_shards_started_and_unconsumed(
    tmp_path: Path, threads: int, depth: int, seed: int
) -> None:
    urls = _urls(20)
    fake = FakeFetch(tmp_path, gated=True)
    consumer = Consumer(
        Prefetcher(fake, urls, threads=threads, depth=depth, stall_timeout=60), fake.consumed
    )
    consumer.start()
    rng = random.Random(seed)
    remaining = list(urls)
    while remaining:  # finish started shards in a random order
        fake.wait_until(lambda: any(u in fake.started for u in remaining))
        with fake.cond:
            url = rng.choice([u for u in remaining if u in fake.started])
        remaining.remove(url)
        fake.open(url)
    assert [s.url for s in consumer.result()] == urls
    assert fake.max_active <= depth
    assert set(fake.calls.values()) == {1}


def test_depth_is_reached(tmp_path: Path) -> None:
    fake = FakeFetch(tmp_path, gated=True)
    urls = _urls(6)
    with Prefetcher(fake, urls, threads=4, depth=4, stall_timeout=60) as shards:
        consumer = Consumer(shards, fake.consumed)
        consumer.start()
        fake.wait_until(lambda: len(fake.started) == 4)
        # The first four, in whatever order their workers reached the fetch.
        assert fake.max_active == 4 and sorted(fake.started) == urls[:4]
        for url in urls:
            fake.open(url)
        assert [s.url for s in consumer.result()] == urls


class LeadFetch:
    """A fetch double for the first shard's lead: every fetch reports ``requesting`` and
    holds until ``answer(url)``, then reports ``downloading`` (or, with ``hit``, ends
    without a phase change) and finishes. Records each fetch's start in order."""

    def __init__(self, root: Path, *, hit: bool = False) -> None:
        self.root = root
        self.hit = hit
        self.cond = threading.Condition()
        self.started: list[str] = []
        self.answered: set[str] = set()
        self.started_before_answer: dict[str, list[str]] = {}

    def answer(self, url: str) -> None:
        with self.cond:
            self.answered.add(url)
            self.cond.notify_all()

    def wait_until(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout=timeout)

    def __call__(self, url: str, progress) -> Path:
        with self.cond:
            self.started.append(url)
            self.cond.notify_all()
        progress(phase="requesting", bytes_done=0, bytes_total=None)
        deadline = time.monotonic() + WAIT
        with self.cond:
            while url not in self.answered:
                assert time.monotonic() < deadline, f"{url} was never answered"
                self.cond.wait(0.01)
            self.started_before_answer[url] = list(self.started)
        if self.hit:
            return _write_shard(self.root, url, lambda **_: None)
        progress(phase="downloading", bytes_done=0, bytes_total=len(url))
        return _write_shard(self.root, url, progress)


def test_the_first_shard_is_requested_alone_until_its_answer(tmp_path: Path) -> None:
    urls = _urls(6)
    fake = LeadFetch(tmp_path)
    consumer = Consumer(Prefetcher(fake, urls, threads=4, depth=4, stall_timeout=60))
    consumer.start()
    assert fake.wait_until(lambda: fake.started == urls[:1])
    # Nothing else may start while the lead waits for its answer (a wait that ends in
    # time would be a failure; this one can only pass for the wrong reason, never flake).
    assert not fake.wait_until(lambda: len(fake.started) > 1, timeout=0.3)
    fake.answer(urls[0])
    # At least: the lead's own worker, done with it, may start a fifth shard at once.
    assert fake.wait_until(lambda: len(fake.started) >= 4), "the others start on its answer"
    assert fake.started_before_answer[urls[0]] == urls[:1]
    for url in urls[1:]:
        fake.answer(url)
    assert [s.url for s in consumer.result()] == urls


def test_a_first_shard_that_ends_without_an_answer_releases_the_others(tmp_path: Path) -> None:
    urls = _urls(3)
    fake = LeadFetch(tmp_path, hit=True)  # ends in "requesting", as a hit found late would
    consumer = Consumer(Prefetcher(fake, urls, threads=3, depth=3, stall_timeout=60))
    consumer.start()
    assert fake.wait_until(lambda: fake.started == urls[:1])
    fake.answer(urls[0])
    assert fake.wait_until(lambda: len(fake.started) == 3)
    for url in urls[1:]:
        fake.answer(url)
    assert [s.url for s in consumer.result()] == urls


def test_the_others_start_after_the_lead_time_without_an_answer(tmp_path: Path) -> None:
    from shardcache._prefetch.workers import LEAD_TIME

    urls = _urls(3)
    clock = FakeClock()
    fake = LeadFetch(tmp_path)
    consumer = Consumer(Prefetcher(fake, urls, threads=3, depth=3, stall_timeout=60, clock=clock))
    consumer.start()
    assert fake.wait_until(lambda: fake.started == urls[:1])
    assert not fake.wait_until(lambda: len(fake.started) > 1, timeout=0.3)
    clock.advance(LEAD_TIME)  # seen by the waiting workers at their next timed wake-up
    assert fake.wait_until(lambda: len(fake.started) == 3)
    assert urls[0] not in fake.answered, "the lead still had no answer"
    for url in urls:
        fake.answer(url)
    assert [s.url for s in consumer.result()] == urls


def test_construction_is_lazy_and_pickles_before_iteration(tmp_path: Path) -> None:
    urls = _urls(5)
    threads_before = set(threading.enumerate())
    shards = Prefetcher(
        functools.partial(_write_shard, tmp_path), urls, threads=3, depth=2, stall_timeout=60
    )
    assert not set(threading.enumerate()) - threads_before, "construction starts no thread"
    clone = pickle.loads(pickle.dumps(shards))
    assert [s.url for s in clone] == urls
    assert [s.path.read_bytes() for s in shards] == [u.encode() for u in urls]

    started = Prefetcher(
        functools.partial(_write_shard, tmp_path), urls, threads=1, depth=2, stall_timeout=60
    )
    assert next(started).url == urls[0]
    with pytest.raises(TypeError, match="started iterating"):
        pickle.dumps(started)
    started.close()


def test_an_infinite_url_iterator_is_pulled_lazily(tmp_path: Path) -> None:
    pulled: list[int] = []

    def endless() -> Iterator[str]:
        for i in itertools.count():
            pulled.append(i)
            yield f"mem://shards/r-{i}"

    depth = 3
    shards = Prefetcher(
        functools.partial(_write_shard, tmp_path),
        endless(),
        threads=2,
        depth=depth,
        stall_timeout=60,
    )
    got = [next(shards).url for _ in range(7)]
    assert got == [f"mem://shards/r-{i}" for i in range(7)]
    assert len(pulled) == 7 + depth - 1, "pulled only to keep depth shards in the window"
    shards.close()
    with pytest.raises(StopIteration):
        next(shards)


def test_close_cancels_fetches_blocked_in_progress(
    tmp_path: Path, prefetch_threads: PrefetchThreads
) -> None:
    fake = FakeFetch(tmp_path, gated=True)
    shards = Prefetcher(fake, _urls(10), threads=3, depth=4, stall_timeout=60)
    consumer = Consumer(shards)
    consumer.start()
    fake.wait_until(lambda: len(fake.started) == 3)
    shards.close()
    prefetch_threads.assert_ended()
    # Each blocked fetch ended at its next progress report with the cancellation, not at
    # its gate's own time limit (an AssertionError after WAIT).
    assert fake.ended == dict.fromkeys(fake.started, "_Cancelled"), fake.ended
    assert consumer.result() == [] and fake.finished == []


@pytest.mark.parametrize("kind", ["foreign", "project"])
def test_a_failing_fetch_surfaces_in_order_naming_the_url(tmp_path: Path, kind: str) -> None:
    urls = _urls(4)
    bad = urls[2]
    original: BaseException = (
        ValueError("boom") if kind == "foreign" else IntegrityError("bad bytes", url=bad)
    )
    fake = FakeFetch(tmp_path, errors={bad: original})
    shards = Prefetcher(fake, urls, threads=2, depth=3, stall_timeout=60)
    assert [next(shards).url, next(shards).url] == urls[:2]
    with pytest.raises(FetchError if kind == "foreign" else IntegrityError) as info:
        next(shards)
    exc = info.value
    assert exc.url == bad
    frames = [f.name for f in traceback.extract_tb(original.__traceback__)]
    assert "__call__" in frames, "the worker's traceback is preserved"
    if kind == "foreign":
        assert bad in str(exc) and "boom" in str(exc)
        assert exc.__cause__ is original
        assert pickle.loads(pickle.dumps(exc)).url == bad
    else:
        assert exc is original
    with pytest.raises(StopIteration):
        next(shards)


def test_an_error_from_the_url_iterator_surfaces_after_earlier_shards(tmp_path: Path) -> None:
    def broken() -> Iterator[str]:
        yield "mem://shards/a"
        yield "mem://shards/b"
        raise UrlError("bad spec", spec="x")

    shards = Prefetcher(
        functools.partial(_write_shard, tmp_path), broken(), threads=2, depth=4, stall_timeout=60
    )
    got = []
    with pytest.raises(UrlError, match="bad spec"):
        for shard in shards:
            got.append(shard.url)
    assert got == ["mem://shards/a", "mem://shards/b"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"threads": 0, "depth": 2, "stall_timeout": 1},
        {"threads": 2, "depth": 0, "stall_timeout": 1},
        {"threads": 2, "depth": 2, "stall_timeout": 0},
        {"threads": 2, "depth": 2, "stall_timeout": 1, "starvation_min_shards": 0},
        {"threads": 2, "depth": 2, "stall_timeout": 1, "starvation_min_span": -1.0},
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        Prefetcher(_write_shard, [], **kwargs)


def test_starved_consumer_gets_one_warning(tmp_path: Path, caplog) -> None:
    clock = FakeClock()
    # Every download takes 1 s of fake time, the consumer none: it waits ~100% of the time.
    fake = FakeFetch(tmp_path, size=2_000_000, clock=clock, seconds=1.0)
    urls = _urls(40)
    shards = Prefetcher(fake, urls, threads=1, depth=1, stall_timeout=1e6, clock=clock)
    with caplog.at_level(logging.WARNING, logger="shardcache._prefetch.prefetcher"), shards:
        assert [s.url for s in shards] == urls
    warnings = [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]
    assert len(warnings) == 1, warnings
    message = warnings[0]
    assert "100%" in message and "2.0 MB/s" in message and "1.00/s" in message
    assert "SHARDCACHE_THREADS" in message and "SHARDCACHE_PREFETCH_DEPTH" in message


def test_no_starvation_warning_when_the_consumer_is_the_bottleneck(tmp_path: Path, caplog) -> None:
    clock = FakeClock()
    fake = FakeFetch(tmp_path, size=2_000_000)  # downloads take no fake time
    shards = Prefetcher(fake, _urls(40), threads=2, depth=4, stall_timeout=1e6, clock=clock)
    with caplog.at_level(logging.WARNING, logger="shardcache._prefetch.prefetcher"), shards:
        for _ in shards:
            clock.advance(1.0)  # the consumer's work: 1 s of fake time per shard
    assert not [r for r in caplog.records if "waited for data" in r.getMessage()]


def test_cache_prefetch_takes_defaults_from_settings(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", threads=3, prefetch_depth=5, stall_timeout=7)
    shards = cache.prefetch(["s3://b/x.tar"])
    assert (shards.threads, shards.depth, shards.stall_timeout) == (3, 5, 7.0)
    assert shards._fetch == cache._fetch_pinned and shards._release == cache._unpin
    assert cache.prefetch([], threads=1, depth=2, stall_timeout=9).depth == 2
    assert pickle.loads(pickle.dumps(shards)).depth == 5


# -- integration: ShardCache over moto S3 ----------------------------------------------


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.mark.parametrize("how", ["break", "close", "gc"])
def test_abandoning_cancels_downloads_and_leaves_no_temp_files(
    s3, tmp_path: Path, how: str, prefetch_threads: PrefetchThreads
) -> None:
    s3.put_objects(BUCKET, {f"big-{i}.tar": _blob(1 << 20, i) for i in range(4)})
    urls = [f"s3://{BUCKET}/big-{i}.tar" for i in range(4)]
    cache = ShardCache(tmp_path / "cache", chunk_size=64 << 10, retry_backoff=0.01)
    mid_download = threading.Semaphore(0)

    def fetch(url: str, progress) -> Path:
        def report(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
            progress(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)
            if url != urls[0] and phase == "downloading" and bytes_done > 0:
                # Hold the download with its .part open until the prefetcher cancels it.
                mid_download.release()
                progress.cancelled.wait(WAIT)
                progress(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)

        return cache.fetch(url, progress=report)

    shards = Prefetcher(fetch, urls, threads=3, depth=4, stall_timeout=60)
    if how == "break":
        for shard in shards:
            assert shard.url == urls[0]
            for _ in urls[1:]:
                assert mid_download.acquire(timeout=WAIT)
            assert _temp_files(tmp_path), "downloads are in flight"
            break
    else:
        assert next(shards).url == urls[0]
        for _ in urls[1:]:
            assert mid_download.acquire(timeout=WAIT)
        assert _temp_files(tmp_path), "downloads are in flight"
        if how == "close":
            shards.close()
        else:
            del shards
            gc.collect()
    prefetch_threads.assert_ended()
    assert not _temp_files(tmp_path)
    assert cache.contains(urls[0]) and not any(cache.contains(u) for u in urls[1:])


def test_missing_shard_raises_not_found_after_the_earlier_shards(s3, tmp_path: Path) -> None:
    objects = {f"ok-{i}.tar": _blob(50_000, i) for i in range(3)}
    s3.put_objects(BUCKET, objects)
    urls = [f"s3://{BUCKET}/ok-0.tar", f"s3://{BUCKET}/ok-1.tar", f"s3://{BUCKET}/missing.tar"]
    urls.append(f"s3://{BUCKET}/ok-2.tar")
    cache = ShardCache(tmp_path / "cache", retry_backoff=0.01)
    got = []
    with pytest.raises(RemoteNotFoundError) as info:
        for url, path in cache.prefetch(urls, threads=2, depth=3, stall_timeout=60):
            got.append((url, path.read_bytes()))
    assert got == [(urls[0], objects["ok-0.tar"]), (urls[1], objects["ok-1.tar"])]
    assert info.value.url == urls[2] and urls[2] in str(info.value)
    files = {f.filename.rsplit("/", 1)[-1] for f in traceback.extract_tb(info.value.__traceback__)}
    assert "remote.py" in files, "the worker's traceback is preserved"
    assert not _temp_files(tmp_path)


@pytest.mark.timeout(90)
def test_hung_download_raises_stall_error_with_diagnostics(
    s3, fault_proxy, tmp_path: Path, prefetch_threads: PrefetchThreads
) -> None:
    s3.put_objects(BUCKET, {f"train-{i}.tar": _blob(200_000, i) for i in range(3)})
    urls = [f"s3://{BUCKET}/train-{i}.tar" for i in range(3)]
    # Margins for a loaded 2-core machine: the prefetch thread's first request makes its
    # own S3 client and connection (fsspec keeps one file system per thread), which took
    # over 2 s once in CI, before the hung GET was even sent.
    io_timeout, stall_timeout = 12.0, 4.0
    cache = ShardCache(
        tmp_path / "cache",
        storage_options={"endpoint_url": fault_proxy.endpoint_url},
        io_timeout=io_timeout,
        retries=0,
    )
    cache.fetch(urls[2])  # a hit for the prefetcher; the server and proxy are warm
    fault_proxy.add_fault("hang", times=1, method="GET", path_contains="train-0.tar")
    shards = cache.prefetch(urls, threads=2, depth=3, stall_timeout=stall_timeout)
    # A StallError (not the read timeout's error, which retries=0 would surface as a
    # FetchError after io_timeout) shows the watchdog fired before the read timed out.
    with pytest.raises(StallError) as info:
        next(shards)
    assert fault_proxy.faults_injected("hang") == 1
    exc = info.value
    message = str(exc)
    assert exc.url == urls[0] and urls[0] in message
    assert exc.thread.startswith(THREAD_NAME_PREFIX) and exc.thread in message
    # The GET hung before its headers (the first request of a cold shard): no size yet.
    assert (exc.bytes_done, exc.bytes_total) == (0, None) and exc.phase == "requesting"
    assert "bytes: 0 done of an unknown total" in message
    assert exc.elapsed >= stall_timeout
    assert 'File "' in message and "in fetch" in message, "the stalled thread's stack"
    # Where it ran, in the message itself (DataLoader rebuilds exceptions from it).
    assert exc.where in message and f"pid {os.getpid()} on " in exc.where
    assert "rank 0/1" in exc.where and "not in a DataLoader worker" in exc.where
    for hint in ("SHARDCACHE_THREADS", "SHARDCACHE_PREFETCH_DEPTH", "SHARDCACHE_STALL_TIMEOUT"):
        assert hint in message
    assert pickle.loads(pickle.dumps(exc)).url == urls[0]
    with pytest.raises(StopIteration):
        next(shards)
    prefetch_threads.assert_ended(io_timeout + 20)  # the hung read ends at its io_timeout
    assert not _temp_files(tmp_path)
    assert log_epoch_summary(0)["stall_errors"] == 1  # and the loader report counts it
