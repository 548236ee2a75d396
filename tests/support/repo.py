"""Where the tests find the repository's files: its root (``ROOT``: the package, docs/,
scripts/, bench/) and this folder (``SUPPORT``: the helper modules and the job scripts the
tests run as processes of their own), wherever the test module itself sits in tests/."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
