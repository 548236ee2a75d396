"""What the launcher says of this node beyond the settings' ranks: the number of processes
on it (torchrun's ``LOCAL_WORLD_SIZE``, SLURM's task counts), for
:func:`shardcache.distributed.rank_info`, and the job's number of nodes, for the cache mesh."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from .._base.errors import ConfigError

_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(text: str, node_rank: int, name: str) -> int:
    """SLURM's compressed list ``"4(x2),3"`` -> the task count of node ``node_rank``."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS_RE.match(part.strip())
        if match is None:
            raise ConfigError(
                f"{name}={text!r} is not a SLURM task list; expected counts with optional "
                "repeats, e.g. 4, 4(x2) or 2(x3),1.",
                name=name,
                value=text,
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if 0 <= node_rank < len(counts):
        return counts[node_rank]
    # Node index unknown or out of range: only a uniform list gives a safe answer.
    if len(set(counts)) == 1:
        return counts[0]
    raise ConfigError(
        f"{name}={text!r} lists {len(counts)} nodes with different task counts, but this "
        f"node's index {node_rank} is not among them; expected SLURM_NODEID below "
        f"{len(counts)}.",
        name=name,
        value=text,
    )


def local_world_size(node_rank: int, env: Mapping[str, str] | None = None) -> int | None:
    """The number of processes on this node (node ``node_rank``): ``LOCAL_WORLD_SIZE``
    (torchrun), ``SLURM_NTASKS_PER_NODE``, or this node's entry of ``SLURM_TASKS_PER_NODE``;
    None when the launcher says nothing. Raises ``ConfigError`` for a malformed value."""
    env = os.environ if env is None else env
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if name in env:
            return _positive(name, env[name], "the number of processes on this node, e.g. 8")
    if "SLURM_TASKS_PER_NODE" in env:
        return parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"], node_rank, "SLURM_TASKS_PER_NODE")
    return None


_NODE_COUNTS = ("GROUP_WORLD_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")


def node_count(env: Mapping[str, str] | None = None) -> int | None:
    """The number of nodes of the job: torchrun's ``GROUP_WORLD_SIZE``, else SLURM's step's
    (or job's) node count; None when the launcher says nothing. Raises ``ConfigError`` for a
    malformed value."""
    env = os.environ if env is None else env
    for name in _NODE_COUNTS:
        if name in env:
            return _positive(name, env[name], "the job's number of nodes, e.g. 4")
    return None


def _positive(name: str, text: str, expected: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{name}={text!r} is not a positive integer; expected {expected}.",
            name=name,
            value=text,
        )
    return value
