"""Where a job's processes meet without a torch.distributed process group: torchrun's agent
store, or a store that SLURM task 0 hosts on the first node of the step, or a shared
directory the user names, for :mod:`shardcache._meeting.board` (the index exchange, the
cache mesh's discovery).

torchrun (static and c10d rendezvous alike) runs a ``TCPStore`` in the agent of node 0 at
``MASTER_ADDR:MASTER_PORT`` for the whole run and tells its workers so with
``TORCHELASTIC_USE_AGENT_STORE=True``; any process of the run may connect to it as a client
(``torch.distributed.rendezvous`` does so for ``init_process_group``). Plain ``srun`` has no
such store: task 0 (``SLURM_PROCID=0``) hosts one on the first node of the step's node list
(task 0 runs there under SLURM's block and cyclic distributions), at
``SHARDCACHE_RENDEZVOUS_PORT`` or a port derived from the job and step ids, as PyTorch
Lightning derives ``MASTER_PORT`` from the job id.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .._base.errors import ConfigError

DERIVED_PORTS = range(25000, 29500)  # below torchrun's 29500 and the kernel's ephemeral ports
_RANGE_RE = re.compile(r"\[([^\]]*)\]")


@dataclass(frozen=True)
class Rendezvous:
    """A store the job's processes meet at: ``host:port``, hosted by this process's rank
    when ``serve`` (else by another process: a client connects); ``launcher`` names who
    says so and ``namespace`` keeps this run's keys apart from another's."""

    launcher: str
    host: str
    port: int
    serve: bool
    namespace: str
    directory: Path | None = None  # the user's shared directory instead of a store

    def describe(self) -> str:
        if self.directory is not None:
            return f"the shared directory {self.directory}"
        who = "hosted by this rank" if self.serve else "as a client"
        return f"{self.launcher}'s store at {self.host}:{self.port} ({who})"


def rendezvous(
    port: int, directory: Path | None = None, env: Mapping[str, str] | None = None
) -> Rendezvous | str:
    """The store this job's processes meet at, or why there is none. ``port`` is the
    ``rendezvous_port`` setting (0: derived from the SLURM job); the task that serves is
    the launcher's task 0, whatever rank a dataset is given. ``directory`` (the
    ``rendezvous_dir`` setting) wins over any store: files there, under any launcher, in
    a folder of the job's id (``SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID``; else ``nojob``)."""
    env = os.environ if env is None else env
    if directory is not None:
        job = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "nojob"
        return Rendezvous("directory", "", 0, False, job, directory)
    if "TORCHELASTIC_RUN_ID" in env:  # torchrun, possibly inside a SLURM job
        if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return (
                "torchrun runs no store its workers may use (TORCHELASTIC_USE_AGENT_STORE is "
                f"{env.get('TORCHELASTIC_USE_AGENT_STORE')!r}, e.g. with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)"
            )
        try:
            agent_port = int(env["MASTER_PORT"])
            host = env["MASTER_ADDR"]
        except (KeyError, ValueError):
            return "torchrun gave no MASTER_ADDR / MASTER_PORT"
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        namespace = f"torchrun/{env['TORCHELASTIC_RUN_ID']}/{restart}"
        return Rendezvous("torchrun", host, agent_port, False, namespace)
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID", "batch")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if job is None or nodes is None or "SLURM_PROCID" not in env:
        return "neither torchrun nor a SLURM step launched this process"
    host = first_node(nodes, "SLURM_STEP_NODELIST")
    chosen = port or derived_port(job, step)
    serve = env["SLURM_PROCID"].strip() == "0"
    return Rendezvous("SLURM", host, chosen, serve, f"slurm/{job}.{step}")


def derived_port(job: str, step: str) -> int:
    """The port of a SLURM step's store: the same in every task of the step, another in
    another step or job (most of the time: ``SHARDCACHE_RENDEZVOUS_PORT`` sets one)."""
    digest = hashlib.sha256(f"{job}.{step}".encode()).digest()
    return DERIVED_PORTS[int.from_bytes(digest[:4], "big") % len(DERIVED_PORTS)]


def first_node(nodes: str, name: str) -> str:
    """The first host of a SLURM node list (``"gpu[007-010,12],cpu1"`` -> ``"gpu007"``),
    without ``scontrol``: SLURM lists a step's nodes in order, so each bracket's first
    value, zero padding kept, names it."""
    depth, end = 0, len(nodes)
    for at, char in enumerate(nodes):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = at
            break
    head = nodes[:end].strip()
    first = _RANGE_RE.sub(lambda match: re.split(r"[-,]", match.group(1))[0].strip(), head)
    if not first or depth < 0 or "[" in first or "]" in first:
        raise ConfigError(
            f"{name}={nodes!r} is not a SLURM node list; expected host names with optional "
            "ranges, e.g. node[01-04],gpu7.",
            name=name,
            value=nodes,
        )
    return first
