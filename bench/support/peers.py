"""Peers read at the same concurrency T as shardcache: each reader returns (samples, bytes).

Every reader is configured as its own documentation recommends (cited next to it). Readers
whose package is missing from the running venv raise ``PeerMissing``; the scenarios report
them as "not installed" (``scripts/bench`` installs them in ``.venv-bench``; ``scripts/test``
runs the smoke test in ``.venv`` without them).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

from bench.support.infra import BUCKET, count_samples

Counted = tuple[int, int]
OnSample = Callable[[], None] | None
STUBS = Path(__file__).parents[1] / "stubs"
NOTES: set[str] = set()  # what the run had to adjust for a peer, printed with B2
# How objects are stored on the fast server: uploaded with the checksum S3 keeps of every
# new object since 2024-12 (rclone keeps it and returns it with x-amz-checksum-mode).
S3_CHECKSUM = "CRC64NVME"
# rclone sends the whole object's checksum with every ranged GET too (S3 sends none for a
# range); botocore's default validation (when_supported) then checks each part against it
# and fails. Against it the s3fs peer validates only when required, as its ranged GETs
# amount to on S3 (its whole-object GETs would be checked there: about 0.15 s/GB with
# awscrt). boto3 keeps its default instead (see checksums_as_on_s3): with "when_required"
# s3transfer's download_file takes another path, reading the first part alone before it
# asks for the others.
NO_RANGE_CHECKSUMS = "when_required"
MD5_PASS_BLOCK = 8 << 20  # bytes read back at a time by md5_pass
LOADER_TIMEOUT = 300.0  # seconds a DataLoader may wait for one sample from its workers


def checksums_as_on_s3(client: Any) -> Any:
    """``client`` (boto3, default checksum validation) validates response checksums as it
    does against S3, where a ranged GET carries none: a ranged GetObject is not checked
    against the whole object's checksum the fast server sends with it. Whole-object GETs are
    checked as botocore's default does. Returns ``client``."""

    def no_check_of_a_range(params: dict[str, Any], **_: Any) -> None:
        if "Range" in params.get("headers", {}):
            checksum = params.get("context", {}).get("checksum")
            if checksum is not None:
                checksum["response_algorithms"] = []

    client.meta.events.register("before-call.s3.GetObject", no_check_of_a_range)
    return client


def md5_pass(path: str | Path, etag: str, part_size: int) -> None:
    """The MD5 check a boto3 user adds after ``download_file``, which checks nothing of a
    ranged download: one pass of ``hashlib`` over the file, read back in order on one
    thread. A single-part ETag is the file's MD5; a multipart upload's ``<md5>-N`` is the
    MD5 of its parts' MD5s, the parts of ``part_size`` bytes (the upload's, which the user
    knows or learns from one HEAD of part 1). Raises ``RuntimeError`` if it does not
    match."""
    etag = etag.strip('"')
    _, _, count = etag.partition("-")
    whole, part, digests, left = hashlib.md5(), hashlib.md5(), [], part_size
    buf = memoryview(bytearray(MD5_PASS_BLOCK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            if not count:
                whole.update(buf[:n])
                continue
            view = buf[:n]
            while view:
                take = view[:left]
                part.update(take)
                left -= len(take)
                view = view[len(take) :]
                if left == 0:
                    digests.append(part.digest())
                    part, left = hashlib.md5(), part_size
    if count:
        if left < part_size:  # the last part, shorter
            digests.append(part.digest())
        whole = hashlib.md5(b"".join(digests))
        seen = f"{whole.hexdigest()}-{len(digests)}"
    else:
        seen = whole.hexdigest()
    if seen != etag:
        raise RuntimeError(f"{path}: MD5 pass gave {seen}, the ETag is {etag}")


class PeerMissing(Exception):
    """A peer's package is not installed in this venv."""


def require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise PeerMissing(module)


def missing(modules: Iterable[str]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def preload() -> None:
    """Import every installed reader's modules (so no timed run pays for an import)."""
    import boto3  # noqa: F401
    import s3fs  # noqa: F401
    import torch.utils.data  # noqa: F401
    import webdataset  # noqa: F401

    import shardcache  # noqa: F401

    for module in ("s3torchconnector", "litdata"):
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    with contextlib.suppress(PeerMissing):
        require_mosaic()


def _loader(dataset: Any, workers: int, **kw: Any) -> Any:
    """torch's DataLoader over an IterableDataset that yields one sample at a time.

    batch_size=None: samples come out one by one, as from the in-process readers; the
    workers are forked (torch's default start method on Linux, said explicitly because
    litdata's ``optimize`` switches the process-wide default to spawn)."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context="fork",
        timeout=LOADER_TIMEOUT,
        **kw,
    )


def tar_samples(streams: Iterable[tuple[str, Any]]) -> Iterator[dict[str, Any]]:
    """WebDataset's own tar expansion and key grouping over (name, binary stream) pairs."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    def opened() -> Iterator[dict[str, Any]]:
        for name, stream in streams:
            try:
                yield {"url": name, "stream": stream}
            finally:
                stream.close()

    return group_by_keys(tar_file_expander(opened()))


# ---------------------------------------------------------------------------- WebDataset
def read_wds_loader(
    urls: list[str], workers: int, cache_dir: str | None = None, on_sample: OnSample = None
) -> Counted:
    """WebDataset (streaming, or with ``cache_dir=``) under DataLoader(num_workers=T).

    WebDataset's documentation ("WebDataset with DataLoader"): pass the WebDataset to a
    DataLoader with ``num_workers``; its default ``workersplitter=split_by_worker`` gives each
    worker every T-th shard. One node here, so ``nodesplitter=None``."""
    import webdataset as wds

    ds = wds.WebDataset(
        urls, shardshuffle=False, cache_dir=cache_dir, nodesplitter=None, empty_check=False
    )
    return count_samples(iter(_loader(ds, workers)), on_sample)


# ---------------------------------------------------------------------------- s3fs / boto3
def read_pool(
    urls: list[str], fetch: Callable[[str], str], threads: int, on_sample: OnSample = None
) -> Counted:
    """Download T objects at once on a thread pool (``fetch(url) -> local path``) and read
    the shards' samples in order as they complete: a hand-made cache of whole files."""
    with ThreadPoolExecutor(threads) as pool:
        paths = pool.map(fetch, urls)  # all submitted now: T in flight, results in order
        return count_samples(tar_samples((p, open(p, "rb")) for p in paths), on_sample)


def s3fs_fetcher(storage_options: dict[str, Any], dest: Path) -> Callable[[str], str]:
    """s3fs ``get`` of one object to a local file. s3fs's sync API may be called from many
    threads (each call runs on fsspec's shared event loop), one instance for all."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **storage_options)

    def fetch(url: str) -> str:
        path = str(dest / url.rsplit("/", 1)[1])
        fs.get(url, path)
        return path

    return fetch


def boto3_fetcher(client: Any, dest: Path) -> Callable[[str], str]:
    """boto3 ``download_file`` with its default TransferConfig. boto3's documentation: a
    low-level client is thread-safe and may be shared by the threads of a pool."""

    def fetch(url: str) -> str:
        key = url.split("/", 3)[3]
        path = str(dest / key.rsplit("/", 1)[-1])
        client.download_file(BUCKET, key, path)
        return path

    return fetch


# ---------------------------------------------------------------------------- s3torchconnector
class S3TarSamples(IterableDataset):
    """An IterableDataset of the samples of the tar objects an S3IterableDataset yields."""

    def __init__(self, objects: Any) -> None:
        self.objects = objects

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return tar_samples((reader.key, reader) for reader in self.objects)


def read_s3torchconnector(
    urls: list[str], endpoint: str, region: str, workers: int, on_sample: OnSample = None
) -> Counted:
    """s3torchconnector 1.5 (CRT client) ``S3IterableDataset`` under DataLoader(num_workers=T).

    Its README: ``S3IterableDataset.from_objects(uris, region=..., enable_sharding=True)``
    splits the objects across DataLoader workers; ``S3ClientConfig(force_path_style=True)``
    and ``endpoint=`` for an S3-compatible server; the default sequential reader
    (``S3ReaderConstructor.sequential()``) for whole-object streaming such as tar shards."""
    require("s3torchconnector")
    from s3torchconnector import S3ClientConfig, S3IterableDataset, S3ReaderConstructor

    objects = S3IterableDataset.from_objects(
        urls,
        region=region,
        endpoint=endpoint,
        s3client_config=S3ClientConfig(force_path_style=True),
        reader_constructor=S3ReaderConstructor.sequential(),
        enable_sharding=True,
    )
    return count_samples(iter(_loader(S3TarSamples(objects), workers)), on_sample)


def s3torchconnector_client(storage_options: dict[str, Any]) -> Any:
    """s3torchconnector's S3Client (CRT), with its README's configuration for an
    S3-compatible server (``endpoint=``, ``S3ClientConfig(force_path_style=True)``)."""
    require("s3torchconnector")
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    return S3Client(
        storage_options["client_kwargs"]["region_name"],
        endpoint=storage_options["endpoint_url"],
        s3client_config=S3ClientConfig(force_path_style=True),
    )


def s3torchconnector_fetch(client: Any, keys: list[str], dest: Path) -> None:
    """Objects to files one at a time; ``get_object`` returns a streaming reader."""
    for key in keys:
        with open(dest / key, "wb") as f:
            shutil.copyfileobj(client.get_object(BUCKET, key), f, 8 << 20)


# ---------------------------------------------------------------------------- litdata
def _sample_fields(tar_bytes: bytes) -> Iterator[tuple[bytes, int]]:
    for sample in tar_samples([("shard", io.BytesIO(tar_bytes))]):
        yield sample["bin"], int(sample["cls"])


def _litdata_items(shard: bytes) -> Iterator[dict[str, Any]]:
    for data, cls in _sample_fields(shard):
        yield {"bin": data, "cls": cls}


def write_litdata(shards: list[bytes], out: Path, chunk_bytes: int) -> list[Path]:
    """Convert the shards' samples with litdata's own ``optimize`` (its documented writer):
    one input per shard, ``chunk_bytes`` about one shard; returns the files written."""
    require("litdata")
    import litdata

    start_method = multiprocessing.get_start_method()
    try:
        litdata.optimize(
            fn=_litdata_items,
            inputs=shards,
            output_dir=str(out),
            chunk_bytes=chunk_bytes,
            num_workers=1,
            mode="overwrite",
        )
    finally:  # optimize sets the process-wide start method to spawn: put it back
        multiprocessing.set_start_method(start_method, force=True)
    return sorted(p for p in out.iterdir() if p.is_file())


def litdata_loader(url: str, storage_options: dict[str, Any], cache_dir: str, workers: int) -> Any:
    """litdata's ``StreamingDataset`` + ``StreamingDataLoader(num_workers=T)`` (its README's
    recipe), reading the optimized chunks from S3 into ``cache_dir``; ``storage_options``
    are its documented pass-through to its boto3 client (endpoint, credentials; taken here
    from our s3fs-style options). Iterate it twice: epoch 1 cold, epoch 2 from its cache."""
    require("litdata")
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.resolver import Dir

    boto3_options = {
        "endpoint_url": storage_options["endpoint_url"],
        "aws_access_key_id": storage_options["key"],
        "aws_secret_access_key": storage_options["secret"],
        "region_name": storage_options["client_kwargs"]["region_name"],
    }
    _litdata_allow_http()
    ds = StreamingDataset(
        input_dir=Dir(path=cache_dir, url=url), storage_options=boto3_options, shuffle=False
    )
    # Its loader needs an int batch_size: batches of one, unwrapped, so samples come one by one.
    return StreamingDataLoader(
        ds,
        batch_size=1,
        collate_fn=_only_item,
        num_workers=workers,
        multiprocessing_context="fork",
        timeout=LOADER_TIMEOUT,
    )


def _litdata_allow_http() -> None:
    """litdata 0.2.76 downloads chunks through obstore, whose client refuses plain http
    unless its ``allow_http`` client option is set, and litdata builds that store with fixed
    client options (``litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS``) that it does not
    let a user extend. The link here is http on loopback, so the benchmark adds
    ``allow_http`` to them (the one change to a peer's configuration; it is said in B2's
    text). Everything else is litdata's own path: obstore for chunks, boto3 for the index."""
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"
        NOTES.add("litdata's obstore client options given allow_http (the link is plain http)")


def _only_item(batch: list[Any]) -> Any:
    """The one sample of a batch of one; litdata hands ``bytes`` fields out as memoryviews
    of its chunk, which cannot cross to the main process: copied to bytes here."""
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in batch[0].items()}


# ---------------------------------------------------------------------------- Mosaic
@contextlib.contextmanager
def _torchvision_stubs() -> Iterator[None]:
    """``import streaming`` imports its vision subpackage, which imports torchvision; this
    machine has no CPU torchvision that imports (the wheel fails with ``operator
    torchvision::nms does not exist``). Stub modules stand in for the two names it imports
    (``torchvision.datasets.VisionDataset`` and ``torchvision.transforms.functional.
    to_tensor``); nothing of them is used for MDS shards (see ENVIRONMENT.md)."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    sys.path.insert(0, str(STUBS))
    NOTES.add(
        "Mosaic Streaming imported with torchvision stand-ins (bench/stubs: no CPU torchvision "
        "here; unused for MDS shards)"
    )
    try:
        yield
    finally:
        sys.path.remove(str(STUBS))


def require_mosaic() -> None:
    require("streaming")
    with _torchvision_stubs():
        import streaming  # noqa: F401


def write_mds(shards: list[bytes], out: Path, size_limit: int) -> list[Path]:
    """Convert with Mosaic's own ``MDSWriter`` (its documented writer), shards of about one
    of ours (``size_limit``); returns the files written."""
    require_mosaic()
    from streaming import MDSWriter

    with MDSWriter(
        out=str(out), columns={"bin": "bytes", "cls": "int"}, size_limit=size_limit
    ) as w:
        for shard in shards:
            for data, cls in _sample_fields(shard):
                w.write({"bin": data, "cls": cls})
    return sorted(p for p in out.iterdir() if p.is_file())


@contextlib.contextmanager
def mds_loader(remote: str, endpoint: str, local: str, workers: int) -> Iterator[Any]:
    """Mosaic's ``StreamingDataset(remote=, local=)`` under a DataLoader(num_workers=T) (its
    documented use; ``S3_ENDPOINT_URL`` points its boto3 client at an S3-compatible
    server). Iterate it twice: epoch 1 cold, epoch 2 from ``local``."""
    require_mosaic()
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    os.environ["S3_ENDPOINT_URL"] = endpoint
    try:
        ds = StreamingDataset(remote=remote, local=local, shuffle=False, batch_size=1)
        yield _loader(ds, workers)
    finally:
        del os.environ["S3_ENDPOINT_URL"]
