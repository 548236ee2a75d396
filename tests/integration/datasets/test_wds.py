"""The WebDataset stage and drop-in, through real DataLoader workers and a moto S3 server."""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import pickle
import tarfile
from pathlib import Path

import pytest
import torch
import webdataset as wds
from processes import COLLECTIVE_TIMEOUT, TOGETHER_TIMEOUT, collect
from threads import PrefetchThreads
from torch.utils.data import DataLoader

import shardcache
from shardcache import ShardCache, TransientFetchError
from shardcache._ops.demo import make_shard
from shardcache.testing import FaultProxy

BUCKET = "wds"
SHARDS = 6
PER_SHARD = 8
pytestmark = pytest.mark.timeout(120)


def _key(shard: int, sample: int) -> str:
    return f"{shard:06d}_{sample:04d}"


@pytest.fixture
def dataset(s3) -> str:
    s3.put_objects(BUCKET, {f"train-{i:06d}.tar": make_shard(i, PER_SHARD) for i in range(SHARDS)})
    return f"s3://{BUCKET}/train-{{000000..{SHARDS - 1:06d}}}.tar"


def _all_keys(shards=range(SHARDS)) -> list[str]:
    return sorted(_key(s, i) for s in shards for i in range(PER_SHARD))


def _pipeline(spec: str, cache: ShardCache, **options) -> wds.DataPipeline:
    return wds.DataPipeline(
        wds.SimpleShardList(spec),
        shardcache.split_by_node,
        wds.split_by_worker,
        shardcache.tarfile_to_samples(cache=cache, threads=2, depth=2, **options),
        wds.to_tuple("__key__", "cls"),
    )


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.timeout(TOGETHER_TIMEOUT)
def test_dataloader_workers_yield_every_sample_once_per_epoch(
    s3, dataset: str, tmp_path: Path, start_method: str
) -> None:
    cache = ShardCache(tmp_path / "cache", retry_backoff=0.01)
    loader = DataLoader(
        _pipeline(dataset, cache),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=mp.get_context(start_method),
    )
    for _epoch in range(2):
        keys = [key for key, _cls in loader]
        assert sorted(keys) == _all_keys()  # every sample, exactly once
    for i in range(SHARDS):  # the second epoch came from the cache
        assert s3.count("GET", BUCKET, f"train-{i:06d}.tar") == 1


def test_stage_yields_streams_and_local_paths_and_keeps_other_keys(
    s3, dataset: str, tmp_path: Path, prefetch_threads: PrefetchThreads
) -> None:
    cache = ShardCache(tmp_path / "cache")
    urls = shardcache.expand_urls(dataset)
    stage = shardcache.stage(cache=cache, threads=2)
    seen = []
    for item in stage([{"url": url, "extra": n} for n, url in enumerate(urls)]):
        assert Path(item["local_path"]) == cache.path_for(item["url"])
        with tarfile.open(fileobj=item["stream"], mode="r|") as tar:
            assert len([m for m in tar if m.isfile()]) == 2 * PER_SHARD
        seen.append((item["url"], item["extra"]))
    assert seen == [(url, n) for n, url in enumerate(urls)]
    prefetch_threads.assert_ended()


BAD_SHARDS = {
    "empty.tar": b"",
    "short.tar": b"oops\n",
    "page.tar": b"<html><body>Access denied</body></html>" * 40,
    "cut.tar": make_shard(90, PER_SHARD)[:7000],  # ends inside the third member's data
}


@pytest.mark.parametrize("name", sorted(BAD_SHARDS))
def test_stage_with_webdatasets_tar_reader_gives_a_shard_format_error_for_a_bad_shard(
    s3, dataset: str, tmp_path: Path, name: str
) -> None:
    s3.put_objects(BUCKET, {name: BAD_SHARDS[name]})
    urls = [*shardcache.expand_urls(dataset)[:2], f"s3://{BUCKET}/{name}"]
    cache = ShardCache(tmp_path / "cache", retry_backoff=0.01)

    def pipeline(handler) -> wds.DataPipeline:
        def webdatasets_tar_reader(opened):  # wds.tarfile_to_samples() without its opener
            files = wds.tariterators.tar_file_expander(opened, handler=handler)
            return wds.tariterators.group_by_keys(files, handler=handler)

        return wds.DataPipeline(
            wds.SimpleShardList(urls),
            shardcache.stage(cache=cache, threads=2),
            webdatasets_tar_reader,
            wds.to_tuple("__key__", "cls"),
        )

    for _reading in ("while it downloads", "from the cache"):
        with pytest.raises(shardcache.ShardFormatError) as raised:
            list(pipeline(wds.reraise_exception))
        message = str(raised.value)
        assert message.startswith(f"{urls[2]}: the shard ") and "Check the source object" in message
        with pytest.warns(UserWarning, match=name):  # webdataset's warn_and_continue
            keys = [key for key, _cls in pipeline(wds.warn_and_continue)]
        assert sorted(keys) == _all_keys(range(2))  # the good shards whole, the bad one skipped


def test_stages_pickle_before_iteration_without_touching_torch_state(tmp_path: Path) -> None:
    stage = shardcache.tarfile_to_samples(cache=ShardCache(tmp_path), threads=3, depth=4)
    clone = pickle.loads(pickle.dumps(stage))
    assert clone.prefetch_options == {"threads": 3, "depth": 4}
    with pytest.raises(TypeError, match="threds"):
        shardcache.stage(threds=3)


def test_corrupt_shard_is_skipped_by_warn_and_continue(
    s3, dataset: str, tmp_path: Path, prefetch_threads: PrefetchThreads
) -> None:
    s3.put_objects(BUCKET, {"train-000002.tar": b"this is not a tar file" * 100})
    cache = ShardCache(tmp_path / "cache")
    pipeline = _pipeline(dataset, cache, handler=wds.warn_and_continue)
    with pytest.warns(UserWarning):
        keys = [key for key, _cls in pipeline]
    assert sorted(keys) == _all_keys([0, 1, 3, 4, 5])
    strict = _pipeline(dataset, ShardCache(tmp_path / "strict"))
    with pytest.raises(shardcache.ShardFormatError, match=r"train-000002\.tar: the shard starts"):
        list(strict)
    prefetch_threads.assert_ended()  # the error stopped the prefetcher; nobody closed it


def test_handler_is_called_once_per_failed_shard_after_retries(
    s3, fault_proxy, dataset: str, tmp_path: Path
) -> None:
    fault_proxy.add_fault("status:500", times=None, method="GET", path_contains="train-000003")
    cache = ShardCache(
        tmp_path / "cache",
        storage_options={"endpoint_url": fault_proxy.endpoint_url},
        retries=2,
        retry_backoff=0.01,
    )
    failures: list[BaseException] = []

    def skip(exn: BaseException) -> bool:
        failures.append(exn)
        return True

    keys = [key for key, _cls in _pipeline(dataset, cache, handler=skip)]
    assert sorted(keys) == _all_keys([0, 1, 2, 4, 5])
    assert len(failures) == 1
    assert isinstance(failures[0], TransientFetchError) and failures[0].attempts == 3
    assert failures[0].url.endswith("train-000003.tar")


def test_handler_returning_false_ends_the_stream(
    s3, fault_proxy, dataset: str, tmp_path: Path
) -> None:
    fault_proxy.add_fault("status:403", times=None, method="GET", path_contains="train-000002")
    cache = ShardCache(
        tmp_path / "cache", storage_options={"endpoint_url": fault_proxy.endpoint_url}
    )
    keys = [key for key, _cls in _pipeline(dataset, cache, handler=lambda exn: False)]
    assert sorted(keys) == _all_keys([0, 1])


def test_failing_shard_raises_with_its_url_by_default(
    s3, dataset: str, tmp_path: Path, prefetch_threads: PrefetchThreads
) -> None:
    spec = [*shardcache.expand_urls(dataset)[:2], f"s3://{BUCKET}/missing.tar"]
    with pytest.raises(shardcache.RemoteNotFoundError, match=r"missing\.tar"):
        list(_pipeline(spec, ShardCache(tmp_path / "cache")))
    prefetch_threads.assert_ended()


def test_close_and_early_break_stop_every_thread(
    s3, dataset: str, tmp_path: Path, prefetch_threads: PrefetchThreads
) -> None:
    cache = ShardCache(tmp_path / "cache")
    pipeline = _pipeline(dataset, cache)
    it = iter(pipeline)
    next(it)
    pipeline.close()  # wds.DataPipeline.close() calls close() on its stages
    prefetch_threads.assert_ended()
    del it
    for _sample in _pipeline(dataset, cache):
        break
    gc.collect()
    prefetch_threads.assert_ended()
    leftovers = [p for p in (tmp_path / "cache").rglob("*.part")]
    assert not leftovers


def test_split_by_node_uses_slurm_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    assert list(shardcache.split_by_node(range(10))) == [1, 4, 7]
    # webdataset's own splitter ignores SLURM and would give every rank everything:
    assert list(wds.split_by_node(range(10))) == list(range(10))


def _split_rank(rank: int, store: str, start, out) -> None:
    # Both ranks meet here first, their imports done: gloo's connection timeout then covers
    # connecting only. Started apart, a rank whose interpreter came up more than the timeout
    # after the other's (a loaded machine) found it gone ("Connection closed by peer").
    start.wait()
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT),
    )
    try:
        out.put((rank, list(shardcache.split_by_node([f"shard-{i}" for i in range(7)]))))
        # No rank leaves the group while the other may still be connecting its mesh.
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.timeout(TOGETHER_TIMEOUT)
def test_split_by_node_gives_disjoint_shards_under_torch_distributed(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_split_rank, args=(rank, str(tmp_path / "store"), start, out))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    try:
        parts = dict(collect(out, procs, len(procs)))  # as long as the ranks live
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert set(parts[0]).isdisjoint(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(f"shard-{i}" for i in range(7))
    assert parts[0] == ["shard-0", "shard-2", "shard-4", "shard-6"]


def test_a_shard_in_hand_when_the_consumer_stops_is_published_not_cancelled(
    s3, dataset: str, tmp_path: Path
) -> None:
    """A consumer that stops with a shard in hand (a mixture ends a source's share on its
    last sample) leaves that shard's download to publish: cached, counted, not fetched
    again. The link is slow, so the rest of the shard is still on its way at the stop."""
    url = f"s3://{BUCKET}/train-000000.tar"
    with FaultProxy("127.0.0.1", s3.port, conn_rate=100e3) as slow:  # ~0.4 s for the shard
        cache = ShardCache(tmp_path / "cache", storage_options={"endpoint_url": slow.endpoint_url})
        samples = shardcache.tarfile_to_samples(cache=cache)(iter([{"url": url}]))
        assert next(samples)["__key__"] == _key(0, 0)  # the first sample, as it arrives
        samples.close()  # the consumer stops
        assert cache.stats().misses == 1 and cache.path_for(url).is_file()
        seen = slow.requests_seen()[("GET", f"/{BUCKET}/train-000000.tar")]
        assert cache.fetch(url) == cache.path_for(url)  # a hit: no second GET
        assert slow.requests_seen()[("GET", f"/{BUCKET}/train-000000.tar")] == seen == 1
