"""Which ``SHARDCACHE_*`` variables of an environment no setting reads (a typo, or a
setting of another version), each with the closest setting's variable; the test suite's
own variables (:data:`DEVELOPER_ENV`) are not settings and not unknown. ``_config`` warns
of them when it resolves settings.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping

from .specs import SPECS

DEVELOPER_ENV = frozenset(
    {
        "SHARDCACHE_BENCH_VENV",
        "SHARDCACHE_HYPOTHESIS",
        "SHARDCACHE_REQUIRE_ACCOUNTS",
        "SHARDCACHE_REQUIRE_SLURM",
        "SHARDCACHE_TEST_CLOCK_SKEW",
        "SHARDCACHE_TORTURE",
        "SHARDCACHE_TORTURE_RESULTS",
    }
)
"""``SHARDCACHE_*`` variables of the test suite and scripts (see Development), not settings."""

_PREFIX = "SHARDCACHE_"


def unknown_env(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Every ``SHARDCACHE_*`` variable of ``env`` that no setting reads, with the closest
    setting's variable (difflib), or None when none is close."""
    env = os.environ if env is None else env
    known = {spec.env.removeprefix(_PREFIX): spec.env for spec in SPECS.values()}
    unknown: dict[str, str | None] = {}
    for var in sorted(env):
        if var.startswith(_PREFIX) and var not in DEVELOPER_ENV:
            tail = var.removeprefix(_PREFIX)
            if tail not in known:
                close = difflib.get_close_matches(tail, known, n=1)
                unknown[var] = known[close[0]] if close else None
    return unknown
