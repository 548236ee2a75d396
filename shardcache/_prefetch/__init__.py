"""The bounded prefetch window, its worker pool and its diagnostics.

Layer 7: imports ``_store`` and lower only; never ``_cache``.
"""
