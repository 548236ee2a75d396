"""Where a job's processes leave records for each other without a process group: the store
the job already has, or files in the user's shared directory.

Layer 3: imports ``_base``, ``_config`` and ``distributed`` only; torch only when a store is
used.
"""
