"""Which cached copy may be served: a regular file this cache trusts (:class:`Trust`), current
by the scope's :class:`~shardcache._store.freshness.Freshness`; a hit's access time recorded for
LRU eviction. A file another user could have written is never served (the miss path
replaces it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .._base.redact import get_logger
from .._base.trust import describe_owner
from .._disk.layout import CacheLayout, ShardId
from .eviction import touch
from .freshness import Freshness

logger = get_logger("shardcache._cache")  # the cache's records keep one logger name


class Hits:
    """The hit check of the cache laid out as ``layout``."""

    def __init__(self, layout: CacheLayout, freshness: Freshness) -> None:
        self._layout = layout
        self.freshness = freshness

    def hit(self, shard: ShardId) -> os.stat_result | None:
        """``shard``'s published copy if it is cached and current (asking the store when its
        check is due), its use recorded; None for a miss."""
        st = self.servable_stat(shard.data_path)
        if st is not None and self.freshness.is_current(shard, st, ask_store=True):
            touch(self._layout, shard.data_path, st.st_mtime)
            return st
        return None

    def current_stat(self, shard: ShardId) -> os.stat_result | None:
        """The published copy's lstat if it may be served without asking the store."""
        st = self.servable_stat(shard.data_path)
        if st is None or not self.freshness.is_current(shard, st, ask_store=False):
            return None
        return st

    def servable_stat(self, final: Path) -> os.stat_result | None:
        """``final``'s lstat if it is a regular file this cache trusts."""
        try:
            st = self._layout.fs.lstat(final)
        except OSError:  # missing, or an untrusted directory on the way (the miss path says)
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        if not self._layout.trust.trusts_file(st):
            logger.warning(
                "not serving %s: it is %s, which this cache does not trust; fetching it again",
                final,
                describe_owner(st),
            )
            return None
        return st
