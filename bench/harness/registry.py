"""The scenarios the harness runs, by id: a title for the report and the function that measures.

B12 is no entry: it mounts JuiceFS and runs as a script of its own
(``python -m bench.scenarios.b12_node_lock``), merging into the same results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.scenarios.b1_warm import b1_warm
from bench.scenarios.b2_cold import b2_cold
from bench.scenarios.b3_node import b3_node
from bench.scenarios.b4_overhead import b4_overhead
from bench.scenarios.b5_memory import b5_memory
from bench.scenarios.b6_large import b6_large
from bench.scenarios.b7_hiding import b7_hiding
from bench.scenarios.b8_cpu import b8_cpu
from bench.scenarios.b9_first_sample import b9_first_sample
from bench.scenarios.b10_resume import b10_resume
from bench.scenarios.b11_bookkeeping import b11_bookkeeping
from bench.scenarios.b13_epochs import b13_epochs
from bench.scenarios.b14_mixture import b14_mixture
from bench.scenarios.b15_fast_server import b15_fast_server
from bench.scenarios.b16_stage_check import b16_stage_check
from bench.support.common import Bench

SCENARIOS: dict[str, tuple[str, Callable[[Bench], dict[str, Any]]]] = {
    "B1": ("warm cache, full WebDataset pipeline", b1_warm),
    "B2": ("cold cache over the shaped link, every peer at equal concurrency", b2_cold),
    "B3": ("processes on one node, node scope, cold", b3_node),
    "B4": ("per-call overhead", b4_overhead),
    "B5": ("memory of a large fetch", b5_memory),
    "B6": (
        "large single object over the shaped link: fast server, moto, SeaweedFS (four kinds)",
        b6_large,
    ),
    "B7": ("latency hiding at a fixed consumer rate", b7_hiding),
    "B8": ("client CPU per GB of a cold fetch", b8_cpu),
    "B9": ("time to first sample, cold", b9_first_sample),
    "B10": ("resume mid-epoch from a checkpoint, warm and cold", b10_resume),
    "B11": ("bookkeeping cost vs the number of cached shards", b11_bookkeeping),
    "B13": ("requests and bytes per epoch over 3 epochs, rank and node scope", b13_epochs),
    "B14": ("mixture throughput against one source alone, hot cache", b14_mixture),
    "B15": (
        "cold throughput against a fast server (rclone), equal objects in flight",
        b15_fast_server,
    ),
    "B16": ("stage()'s format check against plain webdataset, hot cache", b16_stage_check),
}


def number(sid: str) -> int:
    """The number of scenario ``sid`` ("B12" -> 12): the order of the report's rows."""
    return int(sid.removeprefix("B"))
