"""Benchmark infrastructure: the server, the shaped link, shards, CPU accounting, peers' openers."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import resource
import statistics
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

MB = 1_000_000
MiB = 1 << 20
CTX = mp.get_context("spawn")
BUCKET = "bench"


# ---------------------------------------------------------------------------- CPU accounting
def _proc_cpu(pid: int) -> float:
    """User+system CPU seconds of process ``pid`` (0.0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class CpuMeter:
    """CPU used during a block: whole machine (% of all cores) and per process group."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.result: dict[str, float] = {}

    def __enter__(self) -> CpuMeter:
        self._t = time.monotonic()
        self._m = _machine_busy()
        self._self = resource.getrusage(resource.RUSAGE_SELF)
        self._kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._p = {k: _proc_cpu(p) for k, p in self.pids.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.monotonic() - self._t, 1e-9)
        busy, total = _machine_busy()
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        client = (me.ru_utime + me.ru_stime - self._self.ru_utime - self._self.ru_stime) + (
            kids.ru_utime + kids.ru_stime - self._kids.ru_utime - self._kids.ru_stime
        )
        self.result = {
            "machine_cpu_pct": round(100 * (busy - self._m[0]) / max(total - self._m[1], 1), 1),
            "client_cpu_pct": round(100 * client / wall, 1),
        }
        for name, pid in self.pids.items():
            self.result[f"{name}_cpu_pct"] = round(100 * (_proc_cpu(pid) - self._p[name]) / wall, 1)


# ---------------------------------------------------------------------------- shaped link
@dataclass(frozen=True)
class Link:
    latency: float = 0.0
    conn_rate: float | None = None
    total_rate: float | None = None

    def describe(self) -> str:
        parts = [f"{self.latency * 1000:.0f} ms first byte"]
        if self.conn_rate:
            parts.append(f"{self.conn_rate / MB:g} MB/s per connection")
        if self.total_rate:
            parts.append(f"{self.total_rate / MB:g} MB/s aggregate")
        return ", ".join(parts)


def _proxy_main(upstream_port: int, link: Link, conn: Any) -> None:
    from shardcache.testing import FaultProxy

    with FaultProxy(
        "127.0.0.1",
        upstream_port,
        latency=link.latency,
        conn_rate=link.conn_rate,
        total_rate=link.total_rate,
    ) as proxy:
        conn.send(proxy.port)
        while conn.recv() == "requests":  # anything else: stop
            conn.send(dict(proxy.requests_seen()))


class ShapedLink(NamedTuple):
    """A running shaping proxy: its ``endpoint``, its process's ``pid``, and ``requests()``:
    (method, path) -> how many such requests it has seen so far."""

    endpoint: str
    pid: int
    requests: Callable[[], dict[tuple[str, str], int]]


@contextlib.contextmanager
def shaped_proxy(upstream_port: int, link: Link) -> Iterator[ShapedLink]:
    """A FaultProxy with ``link`` shaping in its own process."""
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_proxy_main, args=(upstream_port, link, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("shaping proxy did not start")
        port = parent.recv()

        def requests() -> dict[tuple[str, str], int]:
            parent.send("requests")
            return parent.recv()

        yield ShapedLink(f"http://127.0.0.1:{port}", proc.pid or 0, requests)
    finally:
        stop_helper(parent, proc)


# ---------------------------------------------------------------------------- data
def samples_per_shard(size: int, sample_size: int) -> int:
    """How many samples ``make_shard(size, sample_size, ...)`` writes."""
    return max(1, size // (sample_size + 1536))


def make_shard(size: int, sample_size: int, seed: int) -> bytes:
    """A WebDataset tar of about ``size`` bytes: samples of ``.bin`` (random) + ``.cls``."""
    pool = os.urandom(sample_size + 4096)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples_per_shard(size, sample_size)):
            off = (i * 97 + seed) % 4096
            for ext, data in (
                ("bin", pool[off : off + sample_size]),
                ("cls", str(i % 10).encode()),
            ):
                info = tarfile.TarInfo(f"s{seed:04d}-{i:06d}.{ext}")
                info.size = len(data)
                info.mtime = 0
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def put(s3: Any, objects: dict[str, bytes], multipart_chunk: int | None = None) -> None:
    s3.put_objects(BUCKET, objects, multipart_chunk=multipart_chunk)


# ---------------------------------------------------------------------------- peers' plumbing
def install_wds_s3_opener(storage_options: dict[str, Any]) -> None:
    """Give webdataset's gopen an ``s3://`` opener backed by fsspec (s3fs)."""
    import fsspec
    import webdataset as wds

    def gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
        fs = fsspec.filesystem("s3", **storage_options)
        return fs.open(url, mode)

    wds.gopen_schemes["s3"] = gopen_s3


def presigned(client: Any, urls: list[str], expires: int = 3600) -> list[str]:
    """http(s) URLs of the ``s3://`` objects, signed by ``client`` (its endpoint: the link).

    WebDataset streams http(s) URLs with its built-in opener, ``curl`` in a pipe (one GET
    per shard, bytes handed on as they arrive): its documented way to stream shards from a
    web server or object store. The s3fs opener above reads a whole 50 MB block first."""
    return [
        client.generate_presigned_url(
            "get_object", {"Bucket": u.split("/", 3)[2], "Key": u.split("/", 3)[3]}, expires
        )
        for u in urls
    ]


def count_samples(samples: Iterator[dict[str, Any]], on_sample: Callable[[], None] | None = None):
    n = nbytes = 0
    for sample in samples:
        n += 1
        nbytes += sum(len(v) for k, v in sample.items() if isinstance(v, bytes | bytearray))
        if on_sample is not None:
            on_sample()
    return n, nbytes


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table_main(
    parser: Any, run: Callable[[Any], Any], table: Callable[[Any], str], argv: list[str] | None
) -> int:
    """A table benchmark's ``main``: parse ``argv`` (``parser`` and ``--json FILE``), run,
    print the table, and write the figures as JSON where ``--json`` says."""
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    figures = run(args)
    print(table(figures))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
    return 0


def machine() -> dict[str, Any]:
    import platform

    import fsspec
    import moto
    import s3fs
    import webdataset

    import shardcache

    versions = {
        "python": platform.python_version(),
        "shardcache": getattr(shardcache, "__version__", "0.1.0"),
        "webdataset": webdataset.__version__,
        "fsspec": fsspec.__version__,
        "s3fs": s3fs.__version__,
        "moto": moto.__version__,
    }
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("torch", "boto3", "s3torchconnector", "litdata", "mosaicml-streaming"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = "not installed"
    cpu_model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model,
        "kernel": platform.release(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1),
        "versions": versions,
    }


@contextlib.contextmanager
def env_vars(**values: str) -> Iterator[None]:
    """Set environment variables for the block, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_helper(parent: Any, proc: Any) -> None:
    """Ask a helper process (a proxy) to stop over its pipe, then make sure it did."""
    with contextlib.suppress(OSError, BrokenPipeError):
        parent.send("stop")
    proc.join(10)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
