"""The benchmark harness: the scenarios' registry, the run (``python -m bench``), the report."""
