"""A job's sample index without an index file: one read of each shard across the job, kept
for the next job.

An epoch's split (:mod:`shardcache._datasets.epoch_split`) needs every shard's sample
offsets before the first sample. Without ``index=``, they come from, cheapest first:

* **a kept index**: what an earlier job over the same shard list (the same URLs in the
  same order) learned, kept in the cache root (``<root>/.indexes/<digest>.json``) and,
  where the user allows it (``keep_index="data"``), beside the shards
  (``<dir>/.shardcache-index-<digest>.json``, for every cache that reads them). Nothing
  is fetched; a shard changed since is caught when it is read (the index's offsets are
  checked sample by sample).
* **the job, sharing the work**: each rank learns the offsets of its part of its cache's
  whole shards (:func:`~shardcache._datasets.epoch_split.indexing_shares`, handed out by
  count, so known before any offset), which that cache reads in every epoch anyway,
  through the cache, and the parts go to every rank. With a torch.distributed process
  group in this process (the training process after ``init_process_group``, at
  ``prepare()``, the first ``set_epoch()`` or the first iteration) they are gathered
  (``all_gather_object``, bounded by the group's timeout). Without one (no
  ``init_process_group``, or DataLoader workers, which have none) they are exchanged
  through the store the launcher already runs (:mod:`~shardcache._datasets.index_exchange`):
  torchrun's agent store, or under plain ``srun`` one that task 0 serves from the making
  of the dataset; or, under any launcher, files in a directory every rank sees that the
  user names (``SHARDCACHE_RENDEZVOUS_DIR``). Each rank's first DataLoader worker gives
  its part; the rank's other workers wait for the parts and learn nothing. Each shard is
  read once across the job, and the read fills the cache the epoch reads from.
* **this cache alone**: every shard through this process's cache (one read of each shard
  per cache): one rank, or a launcher with no store to meet at (the INFO line says why).

Why those stores: they exist in every such job and outlive the DataLoader workers, which
come and go with the epochs. torchrun's agent serves ``MASTER_ADDR:MASTER_PORT`` for the
whole run and tells its workers they may use it (``TORCHELASTIC_USE_AGENT_STORE``; torch's
own ``env://`` rendezvous connects to it as a client), so nothing new is opened. Plain
``srun`` runs no store; task 0 serving one on the step's first node at a port derived from
the job id is how PyTorch Lightning finds its ``MASTER_ADDR``/``MASTER_PORT`` under SLURM,
needs no shared file system (a node-local cache root is seen by one node only) and no
``scontrol``. A shared file system is not assumed (few clusters give every job one at a
known path), so the directory is the user's to name. A process group is not made for
this: it needs every rank's training process, which a dataset iterated in DataLoader
workers never has.

Whatever is learned is kept for the next job. Each rank's records carry, beside the
offsets, the identity (size, ETag, version id, checksum) of each of its shards whose copy
its cache holds, as the cache's metadata record has it (no request); ``job_index(...,
identities=)`` hands them to the caller, for the dataset lock
(:mod:`~shardcache._datasets.lock_check`), which then asks the store for no shard another
cache holds. These are observations of this job only: a kept index carries none.

Whole shards were chosen over ranged reads of
the tar headers: a shard's headers can only be walked one member at a time (each header
gives the next one's offset), so a ranged walk costs one GET per member (2,000 for 1,000
samples of two files), and the shard's bytes are wanted in the cache anyway, since each
cache indexes only shards it reads in every epoch (measured in ``bench/studies/index_reads.py``).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import fsspec
import torch.distributed as dist
import torch.utils.data

from .._base.errors import SampleIndexError, ShardCacheError
from .._base.redact import get_logger
from .._cache.shard_cache import ShardCache
from .._config.rendezvous import Rendezvous, rendezvous
from .._config.settings import env_setting
from .._disk.metadata import write_record
from ..distributed import gather_objects
from .dataset_lock import ShardIdentity, cached_identity
from .epoch_split import indexing_shares
from .index_exchange import exchange, serve
from .sample_index import (
    SampleIndex,
    ShardSamples,
    index_document,
    index_records,
    learn,
    write_index,
)

logger = get_logger(__name__)

_UNSHARED = (
    "no torch.distributed process group in this process shares the work with the other "
    "ranks either (call prepare() or set_epoch() in the training process after "
    "init_process_group)"
)
KEEPS = ("cache", "data")  # where a learned index is kept: the cache root, also the data


def in_group(rank: int, world_size: int) -> bool:
    """Whether this process can share the learning with the job's other ranks: a
    torch.distributed process group of the dataset's ``rank`` and ``world_size`` is
    initialised here, and this is no DataLoader worker (a forked worker inherits the
    group's state, not a working group)."""
    if torch.utils.data.get_worker_info() is not None:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return world_size > 1 and (rank, world_size) == (dist.get_rank(), dist.get_world_size())


def rank_part(  # noqa: PLR0917
    shards: int, seed: int, shuffle: bool, rank: int, world_size: int, per_cache: int
) -> list[int]:
    """The shards ``rank`` indexes: its turn of its cache's whole shards (the ``per_cache``
    ranks sharing a cache take them in turn)."""
    own = indexing_shares(shards, seed, shuffle, world_size // per_cache)
    return own[rank // per_cache][rank % per_cache :: per_cache]


def urls_digest(urls: Sequence[str]) -> str:
    """What names the kept index of a shard list other than the dataset's own (its shards
    pinned to recorded versions): the list's digest, as a dataset's identity makes it."""
    return hashlib.sha256("\n".join(urls).encode()).hexdigest()[:32]


def kept_path(cache: ShardCache, digest: str) -> Path:
    """Where the cache root keeps the index of the shard list ``digest``."""
    return cache.layout.root / ".indexes" / f"{digest}.json"


def beside_data(urls: Sequence[str], digest: str) -> str | None:
    """Where an index beside the shards goes: their common directory (None: they have none)."""
    folders = {url.rsplit("/", 1)[0] for url in urls if "/" in url}
    if len(folders) != 1:
        return None
    return posixpath.join(folders.pop(), f".shardcache-index-{digest}.json")


def job_index(
    urls: Sequence[str],
    digest: str,
    cache: ShardCache,
    *,
    mine: Sequence[int],
    layout: tuple[int, int, int],
    threads: int,
    handler: Callable[[BaseException], bool] | None,
    keep: str,
    identities: dict[str, ShardIdentity] | None = None,
) -> SampleIndex:
    """Every shard's samples: a kept index, else learned (``mine``: the shards this rank
    learns while the job's other ranks learn theirs, when they can share the work;
    ``layout``: this rank, the world size and the ranks a cache has). ``identities`` gets
    the identity of each shard another rank's cache holds a copy of, as that rank gave it."""
    rank, world_size, per_cache = layout
    say = logger.info if rank == 0 else logger.debug
    beside = beside_data(urls, digest) if keep == "data" else None
    kept, where = _find_kept(urls, digest, cache, beside)
    own = [urls[shard] for shard in mine]
    giver = _giver()
    if in_group(rank, world_size):
        parts = _gathered({"digest": digest, **_part(own, kept, cache, threads, handler)})
        how = "gathered by torch.distributed"
    elif not isinstance(meet := meeting(world_size, cache), str):
        key = f"{digest}/{world_size}x{per_cache}"
        give = (
            (lambda: {"digest": digest, **_part(own, kept, cache, threads, handler)})
            if (giver)
            else None
        )
        timeout = cache.settings.rendezvous_timeout
        parts = exchange(meet, key, rank, world_size, give, wait=kept is None, timeout=timeout)
        how = f"exchanged through {meet.describe()}"
    else:
        parts, how = None, meet
    if parts is None and kept is not None:  # a rank with a kept index needs no other's part
        say("sample offsets of %d shards: the index kept at %s", len(urls), where)
        return kept
    if parts is None:  # nobody to share the work with
        say(
            "learning the sample offsets of all %d shards through the cache %s (%d threads)%s",
            len(urls),
            cache.layout.scope_dir,
            threads,
            "" if world_size == 1 else f"; {how}: {_UNSHARED}",
        )
        found = learn(urls, cache, threads=threads, handler=handler)
        kept_where = _keep(found, urls, digest, cache, beside if rank == 0 else None)
        say("the sample index: %s", kept_where)
        return found
    found = _merged(parts, urls, digest)
    if identities is not None:
        identities.update(_identities(parts))
    if all(p.get("kept") for p in parts):
        say("sample offsets of %d shards: the index kept at %s", len(urls), where)
        return found
    kept_where = (
        f"kept at {where}"
        if kept is not None
        else _keep(found, urls, digest, cache, beside if rank == 0 else None)
        if giver
        else "kept by the rank's first DataLoader worker"
    )
    say(
        "learned the sample offsets of %d shards once across the job's %d ranks (each "
        "indexed its own cache's shards; %s); %s",
        len(urls),
        len(parts),
        how,
        kept_where,
    )
    return found


def meeting(world_size: int, cache: ShardCache | None) -> Rendezvous | str:
    """Where this job's ranks meet without a process group (torchrun's store, or SLURM
    task 0's), or why they cannot."""
    if world_size == 1:
        return "one rank"
    settings = cache.settings if cache else None
    port = settings.rendezvous_port if settings else env_setting("rendezvous_port")
    directory = settings.rendezvous_dir if settings else env_setting("rendezvous_dir")
    return rendezvous(port, directory)


def serve_exchange(rank: int, world_size: int, cache: ShardCache | None) -> None:
    """In SLURM task 0, making a dataset that may learn its index without a process
    group: serve the step's store from now on, so that DataLoader workers find it."""
    meet = meeting(world_size, cache)
    if not isinstance(meet, str) and meet.serve and not in_group(rank, world_size):
        timeout = cache.settings.rendezvous_timeout if cache else env_setting("rendezvous_timeout")
        serve(meet, timeout)


def _giver() -> bool:
    """Whether this process gives its rank's part: the training process, or its first
    DataLoader worker (the others read the parts, none learns)."""
    info = torch.utils.data.get_worker_info()
    return info is None or info.id == 0


def _part(
    own: Sequence[str],
    kept: SampleIndex | None,
    cache: ShardCache,
    threads: int,
    handler: Callable[[BaseException], bool] | None,
) -> dict[str, Any]:
    """What this rank gives the job: its shards' records (from the kept index, or learned),
    each with the identity of the copy this cache holds (none when it holds none), or the
    error that stopped it (so that every rank raises, none waits)."""
    if kept is not None:
        found = kept
    else:
        try:
            found = learn(own, cache, threads=threads, handler=handler)
        except (ShardCacheError, OSError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    records = {}
    for url in own:
        records[url] = found[url].as_json(url)
        if (identity := cached_identity(cache, url)) is not None:
            records[url]["identity"] = identity.as_json(url)
    return {"kept": kept is not None, "records": records}


def _identities(parts: Sequence[Mapping[str, Any]]) -> dict[str, ShardIdentity]:
    """The identities the ranks gave with their records (of the copies their caches hold)."""
    return {
        url: ShardIdentity.of_record(record["identity"])
        for part in parts
        for url, record in part["records"].items()
        if isinstance(record.get("identity"), Mapping)
    }


def _gathered(part: Mapping[str, Any]) -> list[Any] | None:
    """Every rank's part; a rank that never joins is a :class:`SampleIndexError` once the
    process group's timeout has passed, saying why that happens."""
    try:
        return gather_objects(part)
    except RuntimeError as exc:  # torch.distributed's errors (timeouts, a peer gone)
        raise SampleIndexError(
            "the job's ranks did not all join in learning the sample index within the "
            f"process group's timeout ({type(exc).__name__}: {str(exc)[:300]}). With a "
            "process group, prepare(), the first set_epoch() and the first iteration are "
            "collectives: every rank must call them. A dataset that only some ranks use "
            "needs rank= and world_size= of its own, or index= (shardcache index)",
        ) from exc


def _merged(parts: Sequence[Mapping[str, Any]], urls: Sequence[str], digest: str) -> SampleIndex:
    """The ranks' parts as one index of ``urls``; a rank's error is raised on every rank."""
    for rank, part in enumerate(parts):
        if part.get("error"):
            raise SampleIndexError(
                f"rank {rank} could not learn the sample offsets of its shards: "
                f"{part['error']}. Fix that, or make an index ahead (shardcache index) and "
                "give it as index=",
                rank=rank,
            )
    for rank, part in enumerate(parts):
        if part.get("digest") != digest:
            raise SampleIndexError(
                f"rank {rank} has another shard list (digest {part.get('digest')!r}, this "
                f"rank's {digest!r}): every rank must give the dataset the same shards",
                rank=rank,
                expected=digest,
                seen=part.get("digest"),
            )
    records = {url: record for part in parts for url, record in part["records"].items()}
    missing = [url for url in urls if url not in records]
    if missing:
        raise SampleIndexError(
            f"the ranks learned the sample offsets of all but {len(missing)} of {len(urls)} "
            f"shards (first: {missing[0]!r}): they disagree on the job's layout (rank, "
            "world size or cache scope); give every rank the same",
            missing=len(missing),
            first_missing=missing[0],
        )
    return {url: ShardSamples.from_json(records[url], f"rank records of {url}") for url in urls}


def _find_kept(
    urls: Sequence[str], digest: str, cache: ShardCache, beside: str | None
) -> tuple[SampleIndex | None, str | None]:
    """A kept index of ``urls`` and where it was found: the cache root, then beside the
    data (when allowed); one that cannot be used is learned again (a warning says why)."""
    path = kept_path(cache, digest)
    try:
        size = cache.layout.fs.lstat(path).st_size  # read whole, however large
        document = json.loads(cache.layout.fs.read_small(path, size + 1))
    except FileNotFoundError:
        document = None
    except (OSError, ValueError) as exc:
        logger.warning("the kept sample index %s cannot be read (%s): learning it again", path, exc)
        document = None
    if document is not None:
        index = _usable(document, str(path), urls)
        if index is not None:
            return index, str(path)
    if beside is None:
        return None, None
    try:
        with fsspec.open(beside, "r") as stream:
            document = json.load(stream)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        logger.warning("the sample index %s cannot be read (%s): learning it", beside, exc)
        return None, None
    index = _usable(document, beside, urls)
    return (index, beside) if index is not None else (None, None)


def _usable(document: Any, source: str, urls: Sequence[str]) -> SampleIndex | None:
    try:
        return index_records(document, source, urls)
    except SampleIndexError as exc:
        logger.warning("the kept sample index is not used: %s", exc)
        return None


def _keep(
    index: SampleIndex, urls: Sequence[str], digest: str, cache: ShardCache, beside: str | None
) -> str:
    """Keep ``index`` in the cache root and, when given, at ``beside`` (beside the data);
    says where it was kept. An index missing shards the handler left out is not kept (they
    may be readable next time)."""
    left_out = [url for url in urls if index[url].size == 0 and not index[url].starts]
    if left_out:
        return f"not kept: {len(left_out)} shards were left out (first: {left_out[0]})"
    document = index_document(index, urls)
    places = []
    path = kept_path(cache, digest)
    try:
        write_record(cache.layout, path, document)
        places.append(str(path))
    except OSError as exc:  # only the next job's learning is lost
        logger.warning("cannot keep the sample index at %s: %s", path, exc)
    if beside is not None:
        try:
            write_index(beside, document)
            places.append(beside)
        except (ShardCacheError, OSError) as exc:
            logger.warning("cannot keep the sample index beside the data at %s: %s", beside, exc)
    return f"kept at {' and '.join(places)} for the next job" if places else "not kept"
