"""The demo: read a small WebDataset through the cache with WebDataset + DataLoader.

Without ``source`` it starts an embedded S3 (a moto server on 127.0.0.1, from the ``testing``
extra), writes a deterministic dataset of image-like samples, and fetches it. The server
listens on a port fixed by the cache directory (:func:`demo_port`) so that cache keys (which
include the endpoint) stay the same across runs and a second run shows all hits, while demos
with different cache directories (tests running side by side) do not compete for one port.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .._base.extras import require_extras
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._datasets.urls import expand_urls
from ..testing.s3server import S3Server
from .fetch_progress import LOG_EVERY, FetchProgress

logger = get_logger(__name__)

DEMO_BUCKET = "shardcache-demo"
DEMO_PORT = 47913  # the default cache directory's
DERIVED_PORTS = range(20000, 32000)  # below Linux's ephemeral range (32768-60999)
SAMPLES_PER_SHARD = 32


@dataclass
class DemoReport:
    """What one demo run did."""

    source: str
    cache_dir: Path
    shards: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    samples: int = 0
    seconds: float = 0.0
    endpoint: str | None = None
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        """The report as JSON (``shardcache demo --json``)."""
        out = asdict(self) | {"cache_dir": str(self.cache_dir), "seconds": round(self.seconds, 3)}
        return out | {"failed": [{"source": src, "error": err} for src, err in self.failed]}


def make_shard(index: int, samples: int = SAMPLES_PER_SHARD) -> bytes:
    """A WebDataset tar of ``samples`` image-like samples (``.npy`` 64x64x3 uint8 + ``.cls``)."""
    rng = np.random.default_rng(index)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            key = f"{index:06d}_{i:04d}"
            image = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
            npy = io.BytesIO()
            np.save(npy, image)
            for name, data in ((f"{key}.npy", npy.getvalue()), (f"{key}.cls", b"%d" % (i % 10))):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def run_demo(
    source: str | None = None,
    *,
    cache_dir: Path | None = None,
    shards: int = 16,
    threads: int | None = None,
    fresh: bool = False,
    workers: int = 2,
    stream: TextIO | None = None,
) -> DemoReport:
    """Run the demo (embedded S3 unless ``source`` is given) and return its report; what it
    does and the samples read go to ``stream`` as progress (None: nothing)."""
    require_extras("shardcache demo", "torch", *(("testing",) if source is None else ()))
    if source is not None:
        cache = ShardCache(cache_dir, threads=threads)
        return _run_pipeline(
            source, cache, fresh=fresh, workers=workers, decode=False, stream=stream
        )
    _say(stream, f"demo: starting an embedded S3 server and writing {shards} shards to it")
    server = _start_server(S3Server, demo_port(cache_dir))
    try:
        server.put_objects(
            DEMO_BUCKET, {f"train-{i:06d}.tar": make_shard(i) for i in range(shards)}
        )
        cache = ShardCache(cache_dir, storage_options=server.storage_options(), threads=threads)
        spec = f"s3://{DEMO_BUCKET}/train-{{000000..{shards - 1:06d}}}.tar"
        report = _run_pipeline(
            spec,
            cache,
            fresh=fresh,
            workers=workers,
            decode=True,
            stream=stream,
            samples=shards * SAMPLES_PER_SHARD,
        )
        report.endpoint = server.endpoint_url
        return report
    finally:
        server.stop()


def demo_port(cache_dir: Path | None) -> int:
    """The embedded server's port for a demo caching into ``cache_dir``: the same on every
    run with that directory (stable cache keys)."""
    if cache_dir is None:
        return DEMO_PORT
    digest = zlib.crc32(str(Path(cache_dir).resolve()).encode())
    return DERIVED_PORTS[digest % len(DERIVED_PORTS)]


def _start_server(server_class: type[S3Server], port: int) -> S3Server:
    # A stable port keeps cache keys stable across runs; fall back to any free port.
    try:
        return server_class(port=port).start()
    except Exception as exc:
        logger.warning("port %d unavailable (%s); using a free port: expect misses", port, exc)
        return server_class().start()


def _say(stream: TextIO | None, line: str) -> None:
    if stream is not None:
        stream.write(line + "\n")
        stream.flush()


def _run_pipeline(
    spec: str,
    cache: ShardCache,
    *,
    fresh: bool,
    workers: int,
    decode: bool,
    stream: TextIO | None,
    samples: int | None = None,
) -> DemoReport:
    """The documented pipeline (WebDataset + DataLoader) over ``spec``, through ``cache``;
    progress in samples (of ``samples``, None: unknown) on ``stream``."""
    import torch.utils.data
    import webdataset as wds

    from .._datasets.wds import split_by_node, tarfile_to_samples

    if fresh and cache.settings.scope_dir.exists():
        shutil.rmtree(cache.settings.scope_dir)
    urls = expand_urls(spec)
    cached_before = {url for url in urls if cache.contains(url)}
    tail = [wds.decode(), wds.to_tuple("npy", "cls")] if decode else [wds.to_tuple("__key__")]
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        split_by_node,
        wds.split_by_worker,
        tarfile_to_samples(cache=cache),
        *tail,
    )
    loader = torch.utils.data.DataLoader(pipeline, batch_size=None, num_workers=workers)
    report = DemoReport(source=spec, cache_dir=cache.settings.scope_dir, shards=len(urls))
    _say(stream, f"demo: reading {len(urls)} shards through {cache.settings.scope_dir}")
    progress = FetchProgress(
        samples, stream, LOG_EVERY, label="demo", failures=False, verb=None, unit="sample"
    )
    started = time.monotonic()
    try:
        for _sample in loader:
            report.samples += 1
            progress.finished(spec, ok=True)
    except Exception as exc:  # reported, and the exit code says so
        report.failed.append((spec, f"{type(exc).__name__}: {exc}"))
    finally:
        progress.close()
    report.seconds = time.monotonic() - started
    for url in urls:
        if cache.contains(url):
            report.bytes += cache.path_for(url).stat().st_size
            if url in cached_before:
                report.hits += 1
            else:
                report.misses += 1
    return report


def format_report(report: DemoReport) -> str:
    """The human-readable report printed by ``shardcache demo``."""
    lines = [
        "shardcache demo",
        f"  source     {report.source}"
        + (f"  (embedded S3 at {report.endpoint})" if report.endpoint else ""),
        f"  cache dir  {report.cache_dir}",
        f"  shards     {report.shards} ({report.bytes / 1e6:.1f} MB)",
        f"  hits       {report.hits}",
        f"  misses     {report.misses} (downloaded now)",
    ]
    lines.append(f"  samples    {report.samples} ({report.samples_per_s:.0f} samples/s)")
    lines.append(f"  time       {report.seconds:.2f} s ({report.mb_per_s:.1f} MB/s)")
    for url, error in report.failed:
        lines.append(f"  FAILED     {url}: {error}")
    if not report.failed and report.misses == 0:
        lines.append("  all hits: every shard came from the local cache")
    elif not report.failed:
        lines.append("  run again to see every shard served from the cache")
    return "\n".join(lines)
