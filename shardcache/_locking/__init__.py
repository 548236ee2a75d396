"""The shard lock: waiting, judging and breaking holders; its backends (flock, lease), holder
records, policy, node-local lock and errors.

Layer 5: imports ``_retry`` and lower only; independent of ``_transfer``.
"""
