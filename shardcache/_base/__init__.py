"""The ground everything stands on: errors, redaction, units, process identity, file-system facts,
trust and link-safe file operations, directories, optional extras, URL kinds and checks.

Layer 0: imports nothing of shardcache outside this package.
"""
