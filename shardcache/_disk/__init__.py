"""The on-disk layout of a scope (a shard's paths, every name made and parsed) and a published
shard's metadata record.

Layer 1: imports ``_base`` only.
"""
