"""The cache mesh: a node serves its published shards to the job's other nodes, and fetches
a shard's bytes from the node that holds it (signed HTTP range requests, sendfile on the
serving side, bounded waits on the receiving side).

Layer 7: imports ``_store`` and lower only; independent of ``_prefetch``.
"""
