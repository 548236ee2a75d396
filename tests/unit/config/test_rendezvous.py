"""Where a job's processes meet without a process group (shardcache._config.rendezvous):
torchrun's agent store when torchrun says its workers may use it, else SLURM task 0's store
on the first node of the step's node list, at a port from the job and step ids or the
setting; and why not, when neither applies."""

from __future__ import annotations

import pytest

from shardcache import ConfigError
from shardcache._config.rendezvous import DERIVED_PORTS, Rendezvous, derived_port, first_node
from shardcache._config.rendezvous import rendezvous as meet_at

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "run7",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29400",
}
SLURM = {
    "SLURM_JOB_ID": "4711",
    "SLURM_STEP_ID": "3",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NODELIST": "gpu[007-010,12],cpu1",
    "SLURM_JOB_NODELIST": "gpu[001-010,12],cpu1",
}


@pytest.mark.parametrize(
    ("nodes", "first"),
    [
        ("vm", "vm"),
        ("node[01-04]", "node01"),
        ("gpu[007-010,12],cpu1", "gpu007"),
        ("a,b[1-2]", "a"),
        ("rack[2-3]-n[09,11]", "rack2-n09"),
        (" node7 ", "node7"),
    ],
)
def test_the_first_node_of_a_slurm_node_list(nodes: str, first: str) -> None:
    assert first_node(nodes, "SLURM_STEP_NODELIST") == first


@pytest.mark.parametrize("nodes", ["", "node[01-04", "node]01[", ",a"])
def test_a_malformed_node_list_is_a_config_error(nodes: str) -> None:
    with pytest.raises(ConfigError, match="is not a SLURM node list") as caught:
        first_node(nodes, "SLURM_STEP_NODELIST")
    assert caught.value.name == "SLURM_STEP_NODELIST"


def test_torchrun_workers_meet_at_the_agent_store_as_clients() -> None:
    assert meet_at(0, None, TORCHRUN) == Rendezvous(
        "torchrun", "10.0.0.5", 29400, False, "torchrun/run7/2"
    )
    # torchrun inside a SLURM job: torchrun's store, not a SLURM one.
    assert meet_at(0, None, SLURM | TORCHRUN).launcher == "torchrun"


def test_torchrun_without_an_agent_store_gives_the_reason() -> None:
    why = meet_at(0, None, TORCHRUN | {"TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert isinstance(why, str) and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in why
    assert "MASTER_ADDR" in meet_at(
        0, None, {k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}
    )


def test_slurm_task_zero_serves_on_the_steps_first_node() -> None:
    task1 = meet_at(0, None, SLURM)
    assert task1 == Rendezvous("SLURM", "gpu007", derived_port("4711", "3"), False, "slurm/4711.3")
    task0 = meet_at(0, None, SLURM | {"SLURM_PROCID": "0"})
    assert task0 == Rendezvous("SLURM", "gpu007", task1.port, True, "slurm/4711.3")
    # The job's list when the step's is not given; the setting's port when given.
    job_list = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert meet_at(28001, None, job_list) == Rendezvous(
        "SLURM", "gpu001", 28001, False, "slurm/4711.3"
    )


def test_derived_ports_differ_between_steps_and_jobs_and_stay_in_their_range() -> None:
    ports = {derived_port(str(job), str(step)) for job in range(4700, 4750) for step in range(4)}
    assert ports <= set(DERIVED_PORTS)
    assert len(ports) > 150  # of 200 steps: few share a port
    assert derived_port("4711", "3") == derived_port("4711", "3")


def test_no_launcher_gives_the_reason() -> None:
    assert "neither torchrun nor a SLURM step" in meet_at(0, None, {})
    assert "neither" in meet_at(0, None, {"SLURM_JOB_ID": "1"})  # an allocation, not a step


def test_a_shared_directory_wins_over_any_store(tmp_path) -> None:
    for env, job in ((TORCHRUN, "run7"), (SLURM, "4711"), ({}, "nojob")):
        met = meet_at(0, tmp_path, env)
        assert met == Rendezvous("directory", "", 0, False, job, tmp_path), env
        assert met.describe() == f"the shared directory {tmp_path}"
