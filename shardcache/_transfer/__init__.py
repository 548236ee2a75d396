"""Getting bytes from a remote: file systems and opened objects, the download strategies
(stream, parallel ranges, ``pipe:``), checksums and ``pipe:`` processes.

Layer 5: imports ``_retry`` and lower only; independent of ``_locking``.
"""
