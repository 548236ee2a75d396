"""``python -m bench``: the benchmark harness (see :mod:`bench.harness.cli`)."""

import sys

from bench.harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
