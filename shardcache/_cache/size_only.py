"""Saying which stores' shards are verified by their size only: one warning per store and
process, at the first such shard this process downloads and publishes.

A store is named as a person knows it: ``s3://bucket`` (with the endpoint when one is
set), ``gs://bucket``, ``https://host``; credentials in it are never shown. Local files
and ``pipe:`` commands cross no store, and ``SHARDCACHE_VERIFY=size`` asked for it: no
warning for those (their shards are counted as ``size`` all the same).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from urllib.parse import urlsplit

from .._base.process_local import ProcessLocal
from .._base.redact import get_logger, redact_url
from .._base.url_kinds import LOCAL_PROTOCOLS
from .._disk.layout import ShardId

logger = get_logger("shardcache._cache")  # the cache's records keep one logger name

_NOT_STORES = LOCAL_PROTOCOLS | {"pipe"}


class _Warned:
    """The stores this process has named (inherited by a forked child: a DataLoader worker
    does not repeat what its training process said)."""

    def __init__(self, stores: Iterable[str] = ()) -> None:
        self._stores = set(stores)
        self._lock = threading.Lock()

    def first(self, store: str) -> bool:
        """True the first time ``store`` is seen in this process."""
        with self._lock:
            if store in self._stores:
                return False
            self._stores.add(store)
            return True

    def forked(self) -> _Warned:
        return _Warned(self._stores)


_warned: ProcessLocal[_Warned] = ProcessLocal(_Warned, after_fork=_Warned.forked)


def store_name(shard: ShardId) -> str:
    """The store ``shard`` comes from: ``s3://bucket`` (``at <endpoint>`` when one is set),
    ``gs://bucket``, ``https://host``; never a credential."""
    parts = urlsplit(shard.canonical_url)
    where = parts.netloc.rpartition("@")[2]  # no userinfo
    name = f"{parts.scheme}://{where}"
    endpoint = shard.namespace.partition("@")[2] if shard.namespace.startswith("s3@") else ""
    if endpoint and endpoint != "aws":
        name += f" at {redact_url(endpoint)}"
    return name


def published_by_size(shard: ShardId, verify: str) -> None:
    """``shard`` was downloaded and published, verified by its size only: warn, naming its
    store, unless this process already did (or it is no store's, or ``verify`` is "size")."""
    if shard.protocol in _NOT_STORES or verify == "size":
        return
    store = store_name(shard)
    if _warned.get().first(store):
        logger.warning(
            "objects from %s are verified by their size only: the store describes no "
            "checksum of them that shardcache can check (no full-object checksum, no MD5 "
            "ETag, no layout of a multipart upload's parts; first: %s). A byte changed in "
            "transit would go unnoticed. Upload them with a checksum (e.g. aws s3 cp "
            "--checksum-algorithm CRC64NVME), or set SHARDCACHE_VERIFY=strict to refuse "
            "such objects. Said once per store and process; `shardcache status` counts the "
            "cached shards by how they were verified.",
            store,
            redact_url(shard.canonical_url),
        )
