"""Retrying and pacing remote requests: the retry policy, error causes, and the process's
request-rate throttle.

Layer 4: imports ``_observe`` and lower only.
"""
