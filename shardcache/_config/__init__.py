"""Settings: every setting's spec (default, type, bounds), the parsers, resolution from arguments,
``SHARDCACHE_*`` variables and the launcher, display and unknown-variable warnings.

Layer 1: imports ``_base`` only.
"""
