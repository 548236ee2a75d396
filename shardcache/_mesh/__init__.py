"""The cache mesh: a node serves its published shards to the job's other nodes, and fetches
a shard's bytes from the node that holds it (signed HTTP range requests, sendfile on the
serving side, bounded waits on the receiving side); the nodes find each other through the
job's store or shared directory.

Layer 7: imports ``_store``, ``_meeting`` and lower only; independent of ``_prefetch``.
"""
