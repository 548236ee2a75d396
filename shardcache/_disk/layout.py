"""A shard's identity and where its files live in the cache.

A URL is canonicalised and hashed once per fetch into a :class:`ShardId`, which carries
every path of the shard down the fetch path (data, lock, metadata). Layout::

    <scope>/data/<hh>/<readable>-<digest20><suffix>        published shards
    <scope>/data/<hh>/.<final>.<host>.<pid>.<token>.part   downloads in progress
    <scope>/.locks/<hh>/<digest64>.lock                    lock files (never deleted)
    <scope>/.locks/<hh>/<digest64>.owner|.lease            the holder's record / the lease
    <scope>/.locks/<hh>/<digest64>.<token>.<step>          a lease put aside (LEASE_STEPS)
    <scope>/.locks/evict.lock                              the scope's eviction lock
    <scope>/.locks/index.sqlite (-wal, -shm)               the index of data/ (_index)
    <scope>/.meta/<hh>/<final>.json                        metadata of a published shard
    <scope>/.meta/<hh>/.<final>.json.<pid>.<ns>.tmp        metadata being written

``<digest>`` is the sha256 of the endpoint namespace and the full URL, so distinct URLs
(or the same key on two endpoints) never share a path; ``<readable>`` is only a
sanitised hint for humans, and no URL can make a path leave ``<scope>``.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .._base.errors import ConfigError
from .._base.safefs import SafeFS
from .._base.trust import Trust
from .._base.url_kinds import LOCAL_PROTOCOLS, local_path

_UNSAFE_RE = re.compile(r"[^A-Za-z0-9._-]")
_EXT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
# An extension that may precede the last one (".tar" in ".tar.gz"); must start with a
# letter so shard numbers ("train.000123.tar") stay in the readable stem.
_INNER_EXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9]{0,5}")
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TEMP_RE = re.compile(
    r"^\.(?P<final>.+)\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>[0-9]{1,10})"
    r"\.(?P<token>[A-Za-z0-9_-]{1,64})\.part$"
)
_META_TEMP_RE = re.compile(r"^\.(?P<meta>.+\.json)\.(?P<pid>[0-9]+)\.(?P<ns>[0-9]+)\.tmp$")
LEASE_STEPS = ("claim", "broken", "released")  # a lease's rename-aside files: <hash>.<token>.<step>
_MAX_STEM = 64
_MAX_SUFFIX = 12
_MAX_HOST = 64
_DIGEST_CHARS = 20


# Schemes that name one store each, and the one spelling a cache key uses for them.
_SAME_STORE = {"gcs": "gs", "abfs": "az", "abfss": "az"}


def canonical_url(url: str, protocol: str) -> str:
    """``url`` (of ``protocol``) with a local path made an absolute ``file://`` URL, and a
    store's other schemes spelt as its first (``gcs://`` as ``gs://``; ``abfs://`` and
    ``abfss://`` as ``az://``), so each file or object has one cache entry however it is
    named."""
    if protocol in LOCAL_PROTOCOLS:
        return "file://" + local_path(url)
    same = _SAME_STORE.get(protocol)
    if same is not None:
        return f"{same}://{url.partition('://')[2]}"
    return url


def namespace(
    protocol: str, storage_options: Mapping[str, Any], env_endpoint: str | None = None
) -> str:
    """The store behind URLs of ``protocol`` (its resolved ``storage_options``, else the
    endpoint the environment gives botocore, ``env_endpoint``): equal keys on two S3
    endpoints (two GCS endpoints, two Azure accounts) never share a cache entry."""
    same = _SAME_STORE.get(protocol, protocol)
    if same == "gs":
        endpoint = storage_options.get("endpoint_url")
        return f"gs@{endpoint}" if endpoint else "gs"
    if same == "az":
        return f"az@{_azure_account(storage_options)}"
    if protocol not in {"s3", "s3a"}:
        return protocol
    endpoint = (
        storage_options.get("endpoint_url")
        or (storage_options.get("client_kwargs") or {}).get("endpoint_url")
        or env_endpoint
        or "aws"
    )
    return f"s3@{endpoint}"


def _azure_account(storage_options: Mapping[str, Any]) -> str:
    """The Azure account ``storage_options`` name: its ``account_name``, else the blob
    endpoint or account of its ``connection_string``, else "default" (adlfs then reads
    the account from the environment)."""
    if storage_options.get("account_name"):
        return str(storage_options["account_name"])
    fields = dict(
        item.split("=", 1)
        for item in str(storage_options.get("connection_string") or "").split(";")
        if "=" in item
    )
    return fields.get("BlobEndpoint") or fields.get("AccountName") or "default"


@dataclass(frozen=True)
class ShardId:
    """One shard: its URL as given, its canonical URL and store, and its files' paths.
    Computed once per fetch (:meth:`CacheLayout.identify`) and passed down."""

    url: str
    protocol: str
    canonical_url: str
    namespace: str
    data_path: Path
    lock_path: Path
    meta_path: Path


def cache_key(url: str, namespace: str = "") -> str:
    """Hex sha256 of ``namespace + "\\n" + url`` (namespace: the endpoint, e.g. "s3@host")."""
    if "\n" in namespace:
        # A newline would make (namespace, url) pairs ambiguous, and keys collide.
        raise ConfigError(
            f"Cache namespace {namespace!r} contains a newline; expected a single-line "
            "endpoint identifier such as 's3@http://127.0.0.1:9000'.",
            namespace=namespace,
        )
    data = f"{namespace}\n{url}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def sanitize_name(name: str) -> str:
    """Map ``name`` to ``[A-Za-z0-9._-]`` (others -> ``_``) with no leading dot or dash."""
    return _UNSAFE_RE.sub("_", name).lstrip(".-")


def host_tag() -> str:
    """This host's name as it appears in temp-file names (no dots, filename-safe)."""
    host = _UNSAFE_RE.sub("_", socket.gethostname()).replace(".", "_")[:_MAX_HOST]
    return host or "unknown-host"


def _readable_name(url: str) -> str:
    """The URL's last path component: query/fragment removed, not percent-decoded."""
    rest = url
    scheme_end = rest.find("://")
    if scheme_end >= 0:
        rest = rest[scheme_end + 3 :]
        # Only real URLs have query strings; '?' and '#' are ordinary in local names.
        rest = rest.split("?", 1)[0].split("#", 1)[0]
    rest = rest.rstrip("/")
    return rest.rsplit("/", 1)[-1]


def _split_suffix(name: str) -> tuple[str, str]:
    """(stem, suffix): suffix is the last one or two short, sane extensions, or ""."""
    parts = name.split(".")
    if len(parts) < 2 or not parts[0]:
        return name, ""
    last = parts[-1]
    if not _EXT_RE.fullmatch(last) or len(last) + 1 > _MAX_SUFFIX:
        return name, ""
    if len(parts) >= 3 and parts[-3] and _INNER_EXT_RE.fullmatch(parts[-2]):
        double = f".{parts[-2]}.{last}"
        if len(double) <= _MAX_SUFFIX:
            return ".".join(parts[:-2]), double
    return ".".join(parts[:-1]), f".{last}"


class TempName(NamedTuple):
    """The parts of a temp-file name: ``.<final>.<host>.<pid>.<token>.part``."""

    final: str
    host: str
    pid: int
    token: str


def parse_temp_name(name: str) -> TempName | None:
    """Split a temp-file name into its parts; None when ``name`` is not one."""
    match = _TEMP_RE.match(name)
    if match is None:
        return None
    return TempName(match["final"], match["host"], int(match["pid"]), match["token"])


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a download-in-progress file made by ``temp_path``."""
    return parse_temp_name(name) is not None


def meta_temp_path(meta: Path) -> Path:
    """A unique temp file for writing the record ``meta``: ``.<name>.json.<pid>.<ns>.tmp``."""
    return meta.with_name(f".{meta.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")


def meta_temp_pid(name: str) -> int | None:
    """The writer's pid if ``name`` was made by :func:`meta_temp_path`, else None."""
    match = _META_TEMP_RE.match(name)
    return None if match is None else int(match["pid"])


def owner_path(lock_path: Path) -> Path:
    """The owner record a flock holder keeps beside ``lock_path``: ``<hash>.owner``."""
    return Path(lock_path).with_suffix(".owner")


def lease_path(lock_path: Path) -> Path:
    """The lease (which is also its holder's record) of ``lock_path``: ``<hash>.lease``."""
    return Path(lock_path).with_suffix(".lease")


def lease_step_path(lease: Path, token: str, step: str) -> Path:
    """Where one ``step`` (:data:`LEASE_STEPS`) of a lease operation puts ``lease`` aside."""
    assert step in LEASE_STEPS, step
    return lease.with_name(f"{lease.stem}.{token}.{step}")


def lease_step_of(name: str) -> str | None:
    """The step (:data:`LEASE_STEPS`) a rename-aside file ``name`` was made by, else None."""
    step = name.rsplit(".", 1)[-1]
    return step if "." in name and step in LEASE_STEPS else None


class CacheLayout:
    """Paths of one cache scope directory (``<root>/rank-<R>`` or ``<root>/node``)."""

    def __init__(self, scope_dir: Path | str, trust: Trust | None = None) -> None:
        # Absolute from the start: a relative SHARDCACHE_DIR means the working directory of
        # when the cache was made, not of each later call (and SafeFS resolves from it).
        self.scope_dir = Path(scope_dir).absolute()
        self.trust = Trust.private() if trust is None else trust
        self.fs = SafeFS(self.root, self.trust)
        self.data_dir = self.scope_dir / "data"  # published shards
        self.locks_dir = self.scope_dir / ".locks"  # lock files; eviction never touches it
        self.meta_dir = self.scope_dir / ".meta"  # each published shard's metadata record
        self.samples_dir = self.scope_dir / ".samples"  # a cached shard's sample offsets
        self.evict_lock_path = self.locks_dir / "evict.lock"  # evictions and reservations
        self.index_path = self.locks_dir / "index.sqlite"  # sqlite; -wal and -shm beside it

    @property
    def root(self) -> Path:
        """The cache root (``SHARDCACHE_DIR``) the scope directory is in."""
        return self.scope_dir.parent

    def __repr__(self) -> str:
        return f"CacheLayout({str(self.scope_dir)!r})"

    def identify(self, url: str, protocol: str, namespace: str) -> ShardId:
        """The identity and paths of ``url`` (of ``protocol``, from the store ``namespace``)."""
        canonical = canonical_url(url, protocol)
        key = cache_key(canonical, namespace)
        name, hh = self._data_name(canonical, key), key[:2]
        # joinpath from directories made once: this runs on every hit.
        return ShardId(
            url,
            protocol,
            canonical,
            namespace,
            self.data_dir.joinpath(hh, name),
            self.locks_dir.joinpath(hh, f"{key}.lock"),
            self.meta_dir.joinpath(hh, f"{name}.json"),
        )

    def meta_path(self, final: Path) -> Path:
        """The metadata record of the published file ``final``: ``.meta/<hh>/<name>.json``."""
        return self.meta_dir / final.parent.name / f"{final.name}.json"

    def samples_record_path(self, final: Path) -> Path:
        """The sample offsets learned of the published file ``final`` (once per cached copy):
        ``.samples/<hh>/<name>.json``."""
        return self.samples_dir / final.parent.name / f"{final.name}.json"

    def data_path_of_record(self, record: Path) -> Path:
        """The published file a metadata or sample record describes (inverse of
        :meth:`meta_path` and :meth:`samples_record_path`)."""
        return self.data_dir / record.parent.name / record.name.removesuffix(".json")

    @staticmethod
    def _data_name(url: str, key: str) -> str:
        """The published file's name in ``data/<hh>/``: ``<readable>-<digest20><suffix>``."""
        stem, suffix = _split_suffix(sanitize_name(_readable_name(url)))
        stem = stem[:_MAX_STEM] or "shard"
        # Invariant: the name has no '/', is never '.' or '..' (it holds the digest) and
        # stays below 255 bytes even inside a temp name: 64 + 1 + 20 + 12 = 97.
        return f"{stem}-{key[:_DIGEST_CHARS]}{suffix}"

    def fs_exists(self, path: Path) -> bool:
        """Whether ``path`` (inside the cache) exists, links not followed."""
        try:
            self.fs.lstat(path)
        except OSError:
            return False
        return True

    def make_dir(self, directory: Path) -> None:
        """Create ``directory`` inside the cache (and the root, if missing) with the cache's
        mode, every component checked on the way (:class:`SafeFS`)."""
        self.fs.mkdirs(directory)

    @staticmethod
    def temp_path(final: Path, token: str | None = None) -> Path:
        """A unique download file beside ``final``: ``.<name>.<host>.<pid>.<token>.part``."""
        if token is None:
            token = secrets.token_hex(8)
        elif not _TOKEN_RE.fullmatch(token):
            raise ValueError(f"temp token must match [A-Za-z0-9_-]{{1,64}}, got {token!r}")
        return final.parent / f".{final.name}.{host_tag()}.{os.getpid()}.{token}.part"


_RANK_DIR_RE = re.compile(r"rank-(0|[1-9][0-9]{0,8})")


def parse_scope_dir(name: str) -> tuple[str, int] | None:
    """A scope directory's name back to ``(scope, rank)``: ``"node"`` -> ``("node", 0)``,
    ``"rank-3"`` -> ``("rank", 3)``; None for any other name."""
    if name == "node":
        return "node", 0
    match = _RANK_DIR_RE.fullmatch(name)
    return ("rank", int(match.group(1))) if match else None


def scope_dir(root: Path | str, scope: str, rank: int) -> Path:
    """The scope directory: ``root/rank-<rank>`` for "rank", ``root/node`` for "node"."""
    root = Path(root)
    if scope == "node":
        return root / "node"
    if scope == "rank":
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(
                f"Invalid rank {rank!r} for scope 'rank'; expected an integer >= 0 "
                "(from RANK, SLURM_PROCID or rank=).",
                variable="rank",
                value=rank,
            )
        return root / f"rank-{rank}"
    raise ConfigError(
        f"Invalid cache scope {scope!r} (SHARDCACHE_SCOPE / scope=); expected 'node' "
        "(one cache shared by the processes of a node) or 'rank' (one per rank).",
        variable="SHARDCACHE_SCOPE",
        value=scope,
        accepted=("node", "rank"),
    )


__all__ = [
    "CacheLayout",
    "ShardId",
    "TempName",
    "cache_key",
    "canonical_url",
    "host_tag",
    "is_temp_name",
    "namespace",
    "parse_temp_name",
    "sanitize_name",
    "scope_dir",
]
