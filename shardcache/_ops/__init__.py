"""Operations on a cache: maintenance (``status``, ``clean``), ``verify``, the demo, the metrics
report, building sample indexes and the progress display they share with ``warm``.

Layer 10: imports ``_datasets`` and lower only.
"""
