"""The table of settings: each one's ``SHARDCACHE_*`` variable, parser, default, bounds and
help (:data:`SPECS`), and the launcher variables some of them fall back to
(:data:`LAUNCHER_ENV`). Nothing else holds a default; ``_config`` resolves settings by it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .parse import (
    one_of,
    parse_address,
    parse_byte_rate,
    parse_duration,
    parse_group,
    parse_int,
    parse_json_object,
    parse_metrics_target,
    parse_node_lock_dir,
    parse_optional_rate,
    parse_optional_size,
    parse_path,
    parse_secret,
    parse_size,
    parse_switch,
    parse_upload_rate,
)


@dataclass(frozen=True)
class SettingSpec:
    """How one setting is read: its env variable, parser, bounds and default."""

    env: str
    parse: Callable[[str, str], Any]
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    unset: str = "unset"  # what a value of None means, as ``shardcache config`` shows it


SPECS: dict[str, SettingSpec] = {
    "cache_dir": SettingSpec("SHARDCACHE_DIR", parse_path, None, "cache root (node-local disk)"),
    "scope": SettingSpec(
        "SHARDCACHE_SCOPE",
        one_of("rank", "node"),
        "rank",
        "rank: <dir>/rank-<RANK> per process; node: one <dir>/node per node",
    ),
    "max_bytes": SettingSpec(
        "SHARDCACHE_MAX_BYTES",
        parse_optional_size,
        None,
        "size bound of the cache (0/none: unlimited)",
        unset="unlimited",
    ),
    "lock_mode": SettingSpec(
        "SHARDCACHE_LOCK_MODE",
        one_of("auto", "flock", "lease"),
        "auto",
        "auto: flock on local disks, lease on network file systems",
    ),
    "node_lock_dir": SettingSpec(
        "SHARDCACHE_NODE_LOCK_DIR",
        parse_node_lock_dir,
        None,
        "lease locks: node-local directory of the lock taken before the lease (off: none)",
        unset="<temp dir>/shardcache-<uid>/node-locks",
    ),
    "lock_timeout": SettingSpec(
        "SHARDCACHE_LOCK_TIMEOUT",
        parse_duration,
        3600.0,
        "hard limit on waiting for a lock",
        0.01,
        30 * 86400,
    ),
    "lock_stuck_after": SettingSpec(
        "SHARDCACHE_LOCK_STUCK_AFTER",
        parse_duration,
        300.0,
        "give up on a live lock holder whose progress record has not changed for this long",
        0.01,
        30 * 86400,
    ),
    "lease_time": SettingSpec(
        "SHARDCACHE_LEASE_TIME",
        parse_duration,
        60.0,
        "lease locks: a holder silent this long is presumed dead (renewed every quarter)",
        # Below 1 s a loaded machine can delay a renewal past the lease: live holders
        # would lose their leases.
        1.0,
        86400,
    ),
    "retries": SettingSpec(
        "SHARDCACHE_RETRIES", parse_int, 5, "retries of transient remote errors", 0, 100
    ),
    "retry_backoff": SettingSpec(
        "SHARDCACHE_RETRY_BACKOFF",
        parse_duration,
        0.5,
        "first retry delay (doubles, jittered, capped at 30 s)",
        0,
        3600,
    ),
    "slowdown_retry_time": SettingSpec(
        "SHARDCACHE_SLOWDOWN_RETRY_TIME",
        parse_duration,
        120.0,
        "how long a request the store keeps refusing for its rate (SlowDown, 429, 503) is "
        "retried before those refusals count against SHARDCACHE_RETRIES; 0: every refusal "
        "counts",
        0,
        86400,
    ),
    "io_timeout": SettingSpec(
        "SHARDCACHE_IO_TIMEOUT",
        parse_duration,
        60.0,
        "connect/read timeout of one remote request",
        0.01,
        86400,
    ),
    "chunk_size": SettingSpec(
        "SHARDCACHE_CHUNK_SIZE",
        parse_size,
        8 << 20,
        "download chunk (bounds memory)",
        4096,
        1 << 30,
    ),
    "parallel_threshold": SettingSpec(
        "SHARDCACHE_PARALLEL_THRESHOLD",
        parse_size,
        64 << 20,
        "S3 objects at least this big are fetched with parallel ranged GETs",
        1,
        1 << 50,
    ),
    "part_size": SettingSpec(
        "SHARDCACHE_PART_SIZE",
        parse_size,
        16 << 20,
        "size of one ranged GET of a parallel download",
        4096,
        1 << 32,
    ),
    "parallel_parts": SettingSpec(
        "SHARDCACHE_PARALLEL_PARTS",
        parse_int,
        8,
        "ranged GETs in flight per parallel download (1: never parallel)",
        1,
        256,
    ),
    "max_request_rate": SettingSpec(
        "SHARDCACHE_MAX_REQUEST_RATE",
        parse_optional_rate,
        None,
        "requests/s this process sends to S3 at most (HEADs, GETs, ranged parts, retries); "
        "0/none: no cap. Either way a SlowDown answer slows the whole process down",
        unset="no cap",
    ),
    "job_request_rate": SettingSpec(
        "SHARDCACHE_JOB_REQUEST_RATE",
        parse_optional_rate,
        None,
        "requests/s the whole job sends to S3 at most, shared evenly: each process takes "
        "this / (world size x its rank's DataLoader workers), e.g. 5500 for one S3 prefix; "
        "0/none: no cap",
        unset="no cap",
    ),
    "preallocate": SettingSpec(
        "SHARDCACHE_PREALLOCATE",
        one_of("auto", "off"),
        "auto",
        "auto: reserve each download's full size with posix_fallocate before fetching, "
        "except on network file systems; off: never reserve (the disk can then fill "
        "mid-download: CacheFullError after one eviction pass and one retry)",
    ),
    "verify": SettingSpec(
        "SHARDCACHE_VERIFY",
        one_of("etag", "size", "strict"),
        "etag",
        "etag: size + the cheapest checksum the store describes: its full-object checksum "
        "(S3: CRC64NVME, CRC32C, CRC32, SHA1, SHA256), the ETag's MD5, a multipart upload's "
        "composite checksum or MD5 of its parts' MD5s; size only where the store describes "
        "nothing more; strict: as etag, but a remote shard the store describes by its size "
        "only is refused (UnverifiableError); size: size only",
    ),
    "etag_md5": SettingSpec(
        "SHARDCACHE_ETAG_MD5",
        one_of("auto", "off"),
        "auto",
        "auto: an S3 ETag of the form of an MD5 (or of a multipart upload's MD5 of MD5s) is "
        "checked as one, except where S3 says it is not (KMS or DSSE-KMS, SSE-C, directory "
        "buckets); off: never (an S3-compatible store whose ETags are not MD5s)",
    ),
    "read_while_downloading": SettingSpec(
        "SHARDCACHE_READ_WHILE_DOWNLOADING",
        one_of("on", "off"),
        "on",
        "on: the WebDataset stage and ShardCache.open read a shard this process downloads as "
        "its bytes arrive (the first sample after the first chunk); the file is still "
        "published only verified, and a failed verification raises IntegrityError from the "
        "stream after samples were read from the unverified bytes; off: read only the "
        "verified, published file",
    ),
    "threads": SettingSpec(
        "SHARDCACHE_THREADS", parse_int, 4, "prefetch download threads", 1, 1024
    ),
    "prefetch_depth": SettingSpec(
        "SHARDCACHE_PREFETCH_DEPTH",
        parse_int,
        8,
        "shards downloading or waiting unconsumed",
        1,
        100_000,
    ),
    "stall_timeout": SettingSpec(
        "SHARDCACHE_STALL_TIMEOUT",
        parse_duration,
        300.0,
        "raise StallError when the awaited shard made no progress this long",
        0.01,
        30 * 86400,
    ),
    "revalidate": SettingSpec(
        "SHARDCACHE_REVALIDATE",
        parse_duration,
        0.0,
        "remote shards: a hit last checked longer ago than this asks the store (HEAD) "
        "whether its ETag changed; 0: never (objects are immutable)",
        0.0,
        365 * 86400,
    ),
    "shards_changed": SettingSpec(
        "SHARDCACHE_SHARDS_CHANGED",
        one_of("error", "warn"),
        "error",
        "a dataset's lockfile (lock=): error: shards that changed with no recorded version "
        "to read raise DatasetChangedError; warn: a warning, and they are read as they are",
    ),
    "shared_group": SettingSpec(
        "SHARDCACHE_SHARED_GROUP",
        parse_group,
        None,
        "one cache shared on purpose by the members of this group (name or gid): "
        "directories 2770 and group-owned, files group-readable; unset: private to the user "
        "(directories 0700, files 0600; anything another user could write is refused)",
        unset="unset (private)",
    ),
    "manifest_pipes": SettingSpec(
        "SHARDCACHE_MANIFEST_PIPES",
        one_of("refuse", "allow"),
        "refuse",
        "pipe: URLs (shell commands) listed in a manifest file: refuse (UrlError naming the "
        "manifest and line) or allow; pipe: URLs in your own code and arguments always run",
    ),
    "metrics": SettingSpec(
        "SHARDCACHE_METRICS",
        parse_metrics_target,
        None,
        "append metrics records (JSON lines) to a file per process in this directory "
        "(or a file name pattern with {pid}); off (the default): no files",
        unset="off",
    ),
    "metrics_interval": SettingSpec(
        "SHARDCACHE_METRICS_INTERVAL",
        parse_duration,
        30.0,
        "seconds between interval metrics records while data flows",
        0.001,
        86400,
    ),
    "delivery_check": SettingSpec(
        "SHARDCACHE_DELIVERY_CHECK",
        one_of("raise", "warn", "off"),
        "raise",
        "ResumableDataset / MixtureDataset: what a job delivered of an epoch (a digest and "
        "count in the resume state) against its plan, on resume and at each consumer's end "
        "of epoch; raise: DeliveryMismatchError; warn: a warning; off: not checked",
    ),
    "rendezvous_port": SettingSpec(
        "SHARDCACHE_RENDEZVOUS_PORT",
        parse_int,
        0,
        "plain srun, no process group: the port SLURM task 0 hosts the job's store at, on the "
        "step's first node, to share learning the sample index (0: derived from the job id)",
        0,
        65535,
    ),
    "rendezvous_dir": SettingSpec(
        "SHARDCACHE_RENDEZVOUS_DIR",
        parse_path,
        None,
        "a directory every rank sees (a shared file system): without a process group the "
        "ranks share learning the sample index through files there, under any launcher "
        "(unset: torchrun's store, or SLURM task 0's)",
    ),
    "rendezvous_timeout": SettingSpec(
        "SHARDCACHE_RENDEZVOUS_TIMEOUT",
        parse_duration,
        1800.0,
        "how long a rank waits for the other ranks' parts of the sample index without a "
        "process group (they learn their shards meanwhile)",
        0.01,
        7 * 86400,
    ),
    "mesh": SettingSpec(
        "SHARDCACHE_MESH",
        parse_switch,
        False,
        "the cache mesh: local rank 0 of each node serves its node's published shards to the "
        "job's other nodes and learns their addresses through the job's store (1 or 0)",
    ),
    "mesh_addr": SettingSpec(
        "SHARDCACHE_MESH_ADDR",
        parse_address,
        None,
        "the IP address this node's mesh server binds (never a wildcard)",
        unset="the address of the route to the job's store host",
    ),
    "mesh_secret": SettingSpec(
        "SHARDCACHE_MESH_SECRET",
        parse_secret,
        None,
        "the job's mesh secret, at least 16 bytes, never shown (unset: the key file "
        "~/.config/shardcache/mesh.key, made on first use)",
        unset="the key file",
    ),
    "mesh_upload_rate": SettingSpec(
        "SHARDCACHE_MESH_UPLOAD_RATE",
        parse_upload_rate,
        None,
        "bytes per second a node serves its peers at most, all transfers together; 0: serve "
        "nothing (take only); auto: half the interface's speed, no cap where it is unknown",
        unset="auto",
    ),
    "mesh_concurrency": SettingSpec(
        "SHARDCACHE_MESH_CONCURRENCY",
        parse_int,
        8,
        "transfers a node's mesh server runs at once; more are refused at once (the peer "
        "asks the store)",
        1,
        1024,
    ),
    "mesh_timeout": SettingSpec(
        "SHARDCACHE_MESH_TIMEOUT",
        parse_duration,
        2.0,
        "how long a peer may take from being asked to its answer's first byte (connecting "
        "included), and the longest pause within its answer; then the shard comes from the "
        "store",
        0.01,
        60,
    ),
    "mesh_min_rate": SettingSpec(
        "SHARDCACHE_MESH_MIN_RATE",
        parse_byte_rate,
        20_000_000,
        "the slowest a peer may send a shard: after SHARDCACHE_MESH_TIMEOUT + size / this "
        "rate the fetch goes to the store",
        100_000,
        1e12,
    ),
    "storage_options": SettingSpec(
        "SHARDCACHE_STORAGE_OPTIONS",
        parse_json_object,
        None,
        "JSON object passed to fsspec (e.g. endpoint_url, anon, profile)",
    ),
    "rank": SettingSpec("SHARDCACHE_RANK", parse_int, 0, "global rank", 0, 1 << 24),
    "local_rank": SettingSpec(
        "SHARDCACHE_LOCAL_RANK", parse_int, 0, "rank within the node", 0, 1 << 24
    ),
    "world_size": SettingSpec("SHARDCACHE_WORLD_SIZE", parse_int, 1, "number of ranks", 1, 1 << 24),
    "node_rank": SettingSpec(
        "SHARDCACHE_NODE_RANK", parse_int, 0, "index of this node", 0, 1 << 24
    ),
}

# Launcher variables, in precedence order: torchrun (which may itself run under SLURM) first.
LAUNCHER_ENV: dict[str, tuple[tuple[str, str], ...]] = {
    "rank": (("RANK", "torchrun"), ("SLURM_PROCID", "slurm")),
    "local_rank": (("LOCAL_RANK", "torchrun"), ("SLURM_LOCALID", "slurm")),
    "world_size": (("WORLD_SIZE", "torchrun"), ("SLURM_NTASKS", "slurm")),
    "node_rank": (("GROUP_RANK", "torchrun"), ("SLURM_NODEID", "slurm")),
}
