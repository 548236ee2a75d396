"""Loader metrics: each process's counters, their records and sinks (file, Prometheus,
TensorBoard), the workers' spool, summaries and the epoch line.

Layer 3: imports ``distributed``, ``_config``, ``_disk`` and ``_base`` only.
"""
