"""The cache's stored shards: identities, hits and freshness, space and eviction, the index,
pins, in-flight files and the publish transaction.

Layer 6: imports ``_locking``, ``_transfer`` and lower only.
"""
