"""B9: time to the first sample, cold: shardcache's drop-in against WebDataset with and without
its cache_dir=, in-process, every reader closed (its downloads cancelled) before the next."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from bench.support.common import Bench, clear_fs_caches, new_cache, verdict
from bench.support.infra import MiB, install_wds_s3_opener, median, presigned


@contextlib.contextmanager
def _shardcache(urls: list[str], cache: Any, threads: int) -> Iterator[Iterator[Any]]:
    import webdataset as wds

    import shardcache

    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        shardcache.tarfile_to_samples(cache=cache, threads=threads, depth=2 * threads),
    )
    it = iter(pipeline)
    try:
        yield it
    finally:
        it.close()  # cancels the prefetcher: nothing keeps using the link afterwards
        pipeline.close()


@contextlib.contextmanager
def _webdataset(urls: list[str], cache_dir: str | None) -> Iterator[Iterator[Any]]:
    import webdataset as wds

    ds = wds.WebDataset(
        urls, shardshuffle=False, cache_dir=cache_dir, nodesplitter=None, empty_check=False
    )
    it = iter(ds)
    try:
        yield it
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _first_sample(open_reader: Callable[[], Any]) -> float:
    t0 = time.monotonic()
    with open_reader() as it:
        sample = next(it)
        elapsed = time.monotonic() - t0
    if not sample.get("bin"):
        raise RuntimeError(f"first sample has no payload: {sorted(sample)}")
    return elapsed


def b9_first_sample(b: Bench) -> dict[str, Any]:
    count, size = b.cfg["b9"]
    t: int = b.cfg["threads"]
    urls = b.upload("b9", count, size)
    sc_name = f"shardcache drop-in (threads={t}, read_while_downloading=on, the default)"
    sc_off = f"shardcache drop-in (threads={t}, SHARDCACHE_READ_WHILE_DOWNLOADING=off)"
    runs: dict[str, list[float]] = {}
    with b.link() as (so, _pids):
        install_wds_s3_opener(so)
        streamed = presigned(b.s3.boto3_client(so["endpoint_url"]), urls)
        readers: dict[str, Callable[[], Any]] = {
            sc_name: lambda: _shardcache(
                urls, new_cache(b.fresh_dir("b9"), so, read_while_downloading="on"), t
            ),
            sc_off: lambda: _shardcache(
                urls, new_cache(b.fresh_dir("b9"), so, read_while_downloading="off"), t
            ),
            "webdataset streaming": lambda: _webdataset(streamed, None),
            "webdataset cache_dir=": lambda: _webdataset(urls, str(b.fresh_dir("b9w"))),
        }
        for rep in range(b.cfg["b9_reps"]):
            order = list(readers) if rep % 2 == 0 else list(reversed(readers))  # alternate
            for name in order:
                clear_fs_caches()
                runs.setdefault(name, []).append(_first_sample(readers[name]))
    res = {n: {"first_sample_s": round(median(v), 3), "reps": len(v)} for n, v in runs.items()}
    s = res.pop(sc_name)
    ratio = s["first_sample_s"] / res["webdataset streaming"]["first_sample_s"]
    return {
        "what": f"{count} x {size / MiB:g} MiB shards, cold cache, link: "
        f"{b.cfg['link'].describe()}; seconds from creating the reader to its first sample; "
        "WebDataset streaming reads presigned http URLs with its own curl opener, "
        "cache_dir= the s3:// URLs via s3fs",
        "shardcache": s,
        "peers": res,
        "ratio": round(ratio, 2),
        "target": "time to first sample <= 1.5 x webdataset streaming",
        "verdict": verdict(ratio <= 1.5),
    }
