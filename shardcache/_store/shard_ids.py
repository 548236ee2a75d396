"""Shard identities of one cache: a URL's :class:`~shardcache._disk.layout.ShardId` (canonical
URL, store, paths), computed once and remembered for the most recent ``IDENTITY_MEMO`` URLs
(a hit's largest cost otherwise); each protocol's store resolved once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._base.url_check import check_url
from .._base.url_kinds import LOCAL_PROTOCOLS, url_protocol
from .._config.borrowed import s3_endpoint
from .._disk.layout import CacheLayout, ShardId, namespace

IDENTITY_MEMO = 65_536  # URLs whose identity a cache remembers (oldest dropped first)


class ShardIds:
    """The identities of the URLs a cache is asked for, in ``layout``;
    ``storage_options_for(protocol)`` gives the options that name a protocol's store. The
    ``memo`` most recent URLs are remembered; ``computed`` counts the identities computed
    (asked for and not remembered)."""

    def __init__(
        self,
        layout: CacheLayout,
        storage_options_for: Callable[[str], dict[str, Any]],
        *,
        memo: int = IDENTITY_MEMO,
    ) -> None:
        self._layout = layout
        self._storage_options_for = storage_options_for
        self.memo = memo
        self.computed = 0
        self._namespaces: dict[str, str] = {}  # protocol -> its store, resolved once
        self._identities: dict[str, ShardId] = {}  # url -> its identity (the memo)
        self._lock = threading.Lock()

    def identify(self, url: str) -> ShardId:
        """``url``'s identity and paths; the fetch path passes them on."""
        shard = self._identities.get(url)
        if shard is not None:
            return shard
        check_url(url)
        protocol = url_protocol(url)
        store = self._namespaces.get(protocol)
        if store is None:
            store = namespace(protocol, self._storage_options_for(protocol), s3_endpoint())
            self._namespaces[protocol] = store
        shard = self._layout.identify(url, protocol, store)
        # Relative to the working directory (or ~): not a fixed identity, never remembered.
        fixed = protocol not in LOCAL_PROTOCOLS or url.startswith(("/", "file:///"))
        with self._lock:
            self.computed += 1
            if not fixed:
                return shard
            if len(self._identities) >= self.memo:
                del self._identities[next(iter(self._identities))]  # the oldest remembered
            self._identities[url] = shard
        return shard
