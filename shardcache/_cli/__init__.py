"""The ``shardcache`` command: the parser and exit codes (``main``), what commands share, one module
per command family.

Layer 12: imports ``warm`` and lower only (and the package's ``__version__``).
"""
