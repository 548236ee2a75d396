"""B16: what ``shardcache.stage()``'s format check costs against plain webdataset.

The question: a user who composes ``shardcache.stage()`` with webdataset's own tar reader
gets every stream checked as a tar while ``tarfile`` reads it (``_datasets.tar_guard``), and
a compressed shard decompressed by shardcache, its checksum verified
(``_datasets.decompressed``). What does that cost a sample, against webdataset reading the
same files without shardcache? The network is not what is measured: every shard is in the
cache (fetched before anything is timed) and read from the page cache.

Data. For each sample size in ``samples`` (bytes): ``shards`` tar shards
(``support.infra.make_shard``) of samples of a ``.bin`` of random bytes and a ``.cls``, and the
same tars gzip-compressed (``.tar.gz``, level 6; random bytes barely shrink, as JPEGs do not).
All in one bucket, fetched into one cache.

Readers, each a ``wds.DataPipeline`` iterated in this process, with webdataset's own
``tar_file_expander`` and ``group_by_keys`` after the first stage, samples counted and
nothing decoded:

- *stage()* (shardcache): ``SimpleShardList(urls)``, ``shardcache.stage(cache=cache,
  threads=threads)``;
- *webdataset* (peer): ``SimpleShardList(the cached files' paths)``,
  ``webdataset.tariterators.url_opener`` (what ``wds.WebDataset(paths)`` opens them with).
  For a ``.tar.gz``, webdataset's ``tarfile`` (mode ``r|*``) decompresses it itself.

Before the clock, one pass of each reader over each kind warms the page cache and checks
that both deliver the same samples and bytes (else the row is an error). Then ``reps``
repetitions; in each, for each sample size and kind, the two readers run back to back, their
order alternated between repetitions. Figures: medians of CPU per sample (``process_time``:
the process, its prefetch threads included; steadier than the wall clock beside other jobs)
and of samples/s; ``cpu_ratios`` the median of each pair's stage() / webdataset CPU a sample,
``extra_cpu_us`` the difference of the medians.

No target: the check is what makes a damaged shard a ``ShardFormatError`` instead of a bare
``tarfile.ReadError`` or a silent early end, so this is reported, not judged.
"""

from __future__ import annotations

import gzip
import time
from typing import Any

from bench.support.common import Bench, new_cache
from bench.support.infra import BUCKET, count_samples, make_shard, median, put

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"samples": {4_000: (2, 20)}, "threads": 2, "reps": 1},
    # sample bytes: (shards, samples a shard)
    "full": {"samples": {10_000: (6, 1_000), 100_000: (4, 300)}, "threads": 2, "reps": 7},
}
KINDS = {"tar": ".tar", "tar.gz": ".tar.gz"}
STAGE = "stage() + webdataset's tar reader"
WDS = "webdataset over the cached files (url_opener)"


def _name(reader: str, kind: str, sample: int) -> str:
    return f"{reader}, .{kind}, {sample / 1000:g} kB samples"


def _upload(b: Bench, sample: int, shards: int, per_shard: int) -> dict[str, list[str]]:
    """The shards of one sample size, as ``.tar`` and ``.tar.gz``: kind -> URLs."""
    urls: dict[str, list[str]] = {kind: [] for kind in KINDS}
    size = per_shard * (sample + 1536)  # bench.support.infra.samples_per_shard's inverse
    for i in range(shards):  # one at a time: the client never holds them all
        tar = make_shard(size, sample, i)
        for kind, ext in KINDS.items():
            key = f"b16-{sample}-{i:04d}{ext}"
            put(b.s3, {key: tar if kind == "tar" else gzip.compress(tar, mtime=0)})
            urls[kind].append(f"s3://{BUCKET}/{key}")
    return urls


def _pipeline(reader: str, urls: list[str], cache: Any, threads: int) -> Any:
    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

    import shardcache

    if reader == STAGE:
        first = [wds.SimpleShardList(urls), shardcache.stage(cache=cache, threads=threads)]
    else:
        paths = [str(cache.path_for(url)) for url in urls]
        first = [wds.SimpleShardList(paths), url_opener]
    return wds.DataPipeline(*first, tar_file_expander, group_by_keys)


def _read(reader: str, urls: list[str], cache: Any, threads: int) -> dict[str, Any]:
    """One pass: samples and bytes delivered, wall and CPU seconds."""
    pipeline = _pipeline(reader, urls, cache, threads)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        samples, nbytes = count_samples(iter(pipeline))
    finally:
        pipeline.close()
    return {
        "samples": samples,
        "bytes": nbytes,
        "wall": time.perf_counter() - wall,
        "cpu": time.process_time() - cpu,
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "cpu_us_per_sample": round(median([r["cpu"] / r["samples"] * 1e6 for r in runs]), 2),
        "samples_s": round(median([r["samples"] / r["wall"] for r in runs])),
        "wall_s": round(median([r["wall"] for r in runs]), 3),
        "reps": len(runs),
    }


def b16_stage_check(b: Bench) -> dict[str, Any]:
    cfg = SIZES[b.size]
    cache = new_cache(b.fresh_dir("b16"), b.direct)
    cases: dict[tuple[str, int], list[str]] = {}
    for sample, (shards, per_shard) in cfg["samples"].items():
        for kind, urls in _upload(b, sample, shards, per_shard).items():
            for url in urls:  # hot: nothing below goes to the server
                cache.fetch(url)
            cases[kind, sample] = urls
    errors: dict[str, str] = {}
    for (kind, sample), urls in cases.items():  # untimed: the page cache, the same samples
        got = {r: _read(r, urls, cache, cfg["threads"]) for r in (STAGE, WDS)}
        delivered = {r: (g["samples"], g["bytes"]) for r, g in got.items()}
        if len(set(delivered.values())) != 1 or not delivered[WDS][0]:
            errors[_name(STAGE, kind, sample)] = f"samples and bytes delivered: {delivered}"
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(cfg["reps"]):
        readers = (STAGE, WDS) if rep % 2 == 0 else (WDS, STAGE)  # alternated
        for (kind, sample), urls in cases.items():
            for reader in readers:
                run = _read(reader, urls, cache, cfg["threads"])
                runs.setdefault(_name(reader, kind, sample), []).append(run)
    rows = {name: _summary(rs) for name, rs in runs.items()}
    ratios, extra = {}, {}
    for kind, sample in cases:
        ours, theirs = runs[_name(STAGE, kind, sample)], runs[_name(WDS, kind, sample)]
        case = f".{kind}, {sample / 1000:g} kB"
        pairs = [
            s["cpu"] / s["samples"] / (w["cpu"] / w["samples"])
            for s, w in zip(ours, theirs, strict=True)
        ]
        ratios[case] = round(median(pairs), 3)
        extra[case] = round(
            rows[_name(STAGE, kind, sample)]["cpu_us_per_sample"]
            - rows[_name(WDS, kind, sample)]["cpu_us_per_sample"],
            2,
        )
    first = next(iter(cases))
    head = _name(STAGE, *first)
    sizes = ", ".join(
        f"{shards} shards of {per} samples of {sample / 1000:g} kB"
        for sample, (shards, per) in cfg["samples"].items()
    )
    return {
        "what": f"{sizes}, each as .tar and as .tar.gz (gzip level 6 of random bytes), hot "
        f"cache (fetched before the clock, one untimed pass of each reader first), in-process, "
        f"samples counted and nothing decoded; shardcache: webdataset's tar_file_expander and "
        f"group_by_keys after shardcache.stage(threads={cfg['threads']}); peer: the same after "
        f"webdataset's url_opener over the cached files' paths; CPU a sample is the process's "
        f"(its threads included); medians of {cfg['reps']} repetitions, the pair's order "
        f"alternated; cpu_ratios: median of the paired stage() / webdataset CPU a sample",
        "label": head,
        "shardcache": rows.pop(head),
        "peers": rows,
        "ratio": ratios[f".{first[0]}, {first[1] / 1000:g} kB"],
        "cpu_ratios": ratios,
        "extra_cpu_us": extra,
        "target": "none: reported (what the format check and shardcache's decompression cost "
        "a sample against webdataset reading the same files)",
        "verdict": "reported",
        "row_errors": errors,
    }
