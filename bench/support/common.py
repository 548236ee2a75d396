"""What every scenario shares: sizes, the Bench (server + shaped link), readers, timing."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.support.infra import (
    BUCKET,
    MB,
    CpuMeter,
    Link,
    MiB,
    count_samples,
    make_shard,
    median,
    put,
    shaped_proxy,
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "reps": 1,
        "threads": 2,  # T: shardcache's threads and every peer's concurrency in B2/B7/B9
        "sample": 20_000,
        "b1": (4, 256_000),
        "b2": (4, 400_000),
        "b3": (4, 200_000, 2),
        "b4_calls": 200,
        "b5": 8 * MiB,
        "b6": (4 * MiB, 1 * MiB, 2 * MiB),  # object, part size, threshold
        # B6's four kinds of object on SeaweedFS, which refuses upload parts under 5 MiB
        "b6_kinds": (10 * MiB, 5 * MiB, 8 * MiB),
        "b7": (3, 300_000),
        "link": Link(0.005, 20 * MB, 40 * MB),  # tiny: the plumbing, not the figures
        "b7_rate": 2 * MB,
        "ceiling": (2, 1 * MiB),
        "b8": (2, 2 * MiB),
        "b9": (2, 512 * 1024),
        "b9_reps": 1,
    },
    "full": {
        "reps": 3,
        "threads": 8,
        "sample": 100_000,
        "b1": (32, 16 * MiB),
        "b2": (16, 8 * MiB),  # 2 shards per worker at T=8
        "b3": (32, 4 * MiB, 8),
        "b4_calls": 5000,
        "b5": 1024 * MiB,
        "b6": (96 * MiB, 12 * MiB, 48 * MiB),  # object, part, threshold: see B6
        "b6_kinds": (96 * MiB, 12 * MiB, 48 * MiB),  # uploaded in parts of `part` too
        "b7": (16, 8 * MiB),
        "link": Link(0.04, 10 * MB, 50 * MB),
        "b7_rate": 20 * MB,
        "ceiling": (8, 16 * MiB),
        "b8": (8, 32 * MiB),
        "b9": (4, 32 * MiB),  # ~33.5 MB shards
        "b9_reps": 9,  # a first sample is one round trip: its median needs more runs
    },
}
THREADS = 8  # shardcache prefetch threads in the shaped scenarios (SHARDCACHE_THREADS)


class Bench:
    def __init__(self, size: str, work: Path) -> None:
        from shardcache.testing import S3Server

        self.size = size
        self.cfg = SIZES[size]
        self.work = work
        self.s3 = S3Server().start()
        self.server_pid = self.s3._proc.pid  # type: ignore[union-attr]
        self.direct = self.s3.storage_options()
        for k, v in self.s3.env().items():
            os.environ[k] = v
        self._n = 0

    def close(self) -> None:
        self.s3.stop()

    def fresh_dir(self, name: str) -> Path:
        self._n += 1
        path = self.work / f"{name}-{self._n}"
        path.mkdir(parents=True)
        return path

    def upload(self, prefix: str, count: int, size: int) -> list[str]:
        objects = {
            f"{prefix}-{i:06d}.tar": make_shard(size, self.cfg["sample"], i) for i in range(count)
        }
        put(self.s3, objects)
        return [f"s3://{BUCKET}/{k}" for k in objects]

    @contextlib.contextmanager
    def link(self, link: Link | None = None) -> Iterator[tuple[dict[str, Any], dict[str, int]]]:
        with shaped_proxy(self.s3.port, link or self.cfg["link"]) as shaped:
            so = self.s3.storage_options(shaped.endpoint)
            yield so, {"server": self.server_pid, "proxy": shaped.pid}

    def gets(self, prefix: str) -> int:
        return sum(1 for r in self.s3.requests("GET") if r.key.startswith(prefix))


def clear_fs_caches() -> None:
    import fsspec
    import s3fs

    fsspec.AbstractFileSystem.clear_instance_cache()
    s3fs.S3FileSystem.clear_instance_cache()


def new_cache(root: Path, storage_options: dict[str, Any], **kw: Any):
    from shardcache import ShardCache

    return ShardCache(root, storage_options=storage_options, **kw)


# ---------------------------------------------------------------------------- readers
def read_shardcache(urls: list[str], cache: Any, threads: int = THREADS, on_sample=None):
    import webdataset as wds

    import shardcache

    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        shardcache.tarfile_to_samples(cache=cache, threads=threads, depth=2 * threads),
    )
    try:
        return count_samples(iter(pipeline), on_sample)
    finally:
        pipeline.close()


def read_wds(urls: list[str], cache_dir: str | None = None, on_sample=None):
    import webdataset as wds

    ds = wds.WebDataset(
        urls, shardshuffle=False, cache_dir=cache_dir, nodesplitter=None, empty_check=False
    )
    return count_samples(iter(ds), on_sample)


def read_fsspec(urls: list[str], chain: str | None, storage_options: dict[str, Any], d: str):
    import fsspec
    import webdataset as wds

    def opener(src):
        for item in src:
            url = item["url"]
            if chain is None:
                stream = fsspec.open(url, "rb", **storage_options).open()
            else:
                stream = fsspec.open(
                    f"{chain}::{url}", "rb", s3=storage_options, **{chain: {"cache_storage": d}}
                ).open()
            try:
                yield {"url": url, "stream": stream}
            finally:
                stream.close()

    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls), opener, wds.tariterators.tar_file_expander
    )
    from webdataset.tariterators import group_by_keys

    return count_samples(group_by_keys(iter(pipeline)))


def timed(fn: Callable[[], Any], pids: dict[str, int]) -> dict[str, Any]:
    with CpuMeter(pids) as meter:
        t0 = time.monotonic()
        out = fn()
        wall = time.monotonic() - t0
    return {"wall": wall, "out": out, **meter.result}


def summarise(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    wall = median([r["wall"] for r in runs])
    res = {"wall_s": round(wall, 3), "mb_s": round(nbytes / MB / wall, 2), "reps": len(runs)}
    for key in runs[0]:
        if key.endswith("_cpu_pct"):
            res[key] = round(median([r[key] for r in runs]), 1)
    return res


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"
