"""``ShardCache``, the facade over a fetch, and its units: the miss path, the cache's locks,
early-read offers, pinned fetches and counters.

Layer 8: imports ``_prefetch`` and lower only.
"""
