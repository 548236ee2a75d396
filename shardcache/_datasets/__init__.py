"""What reads through the cache: URL specs and manifests, the WebDataset stages and class,
``ResumableDataset`` (plans, splits, state, shuffle buffer, sample index) and mixtures.

Layer 9: imports ``_cache`` and lower only.
"""
