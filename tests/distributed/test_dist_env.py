"""Pure-function tests of the process boundary: launcher-variable parsing (torchrun, SLURM), the
single-process fake, and the bitwise comparison used by the 1-vs-N-process parity checks."""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch

from cluster_fl.distributed import (LocalComm, bitwise_differences, detect_launch, env_from_slurm,
                                    expand_nodelist, init_comm, parse_nodelist, slurm_port)
from cluster_fl.distributed.launch import scontrol_hostnames

NODELISTS = [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu5", ["gpu5"]),
    ("a1,b[8-10],c", ["a1", "b8", "b9", "b10", "c"]),
    ("r[1-2]-n[3,05]", ["r1-n3", "r1-n05", "r2-n3", "r2-n05"]),
    ("x[009-011]", ["x009", "x010", "x011"]),
]


@pytest.mark.parametrize("nodelist, hosts", NODELISTS)
def test_the_nodelist_parser_expands_ranges_and_keeps_padding(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts
    assert expand_nodelist(nodelist) == hosts  # scontrol's answer where it is installed


@pytest.mark.parametrize("bad", ["node[01-", "node]1[", "node[3-1]", "node[a-b]"])
def test_the_nodelist_parser_rejects_malformed_lists(bad):
    with pytest.raises(ValueError, match="SLURM node list"):
        parse_nodelist(bad)


@pytest.mark.parametrize("nodelist", [n for n, _ in NODELISTS]
                         + ["gpu[1-3,10-12],cpu7", "n[0-1]x[2-3]", "a-b[1-2],c[07-9]"])
def test_the_nodelist_parser_agrees_with_scontrol(nodelist, tmp_path, monkeypatch):
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed here (CI installs slurm-client)")
    if "SLURM_CONF" not in os.environ:  # expanding a host list needs a config, not a cluster
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=t\nSlurmctldHost=localhost\n"
                        "NodeName=localhost CPUs=1 State=UNKNOWN\n"
                        "PartitionName=p Nodes=localhost Default=YES\n")
        monkeypatch.setenv("SLURM_CONF", str(conf))
    hosts = scontrol_hostnames(nodelist)
    assert hosts is not None, "scontrol show hostnames refused a valid host list"
    assert parse_nodelist(nodelist) == hosts


def test_without_scontrol_the_parser_answers(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert scontrol_hostnames("node[1-2]") is None
    assert expand_nodelist("node[1-2]") == ["node1", "node2"]


def _slurm(**extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "cn[12-15]", "SLURM_JOB_ID": "4242", "SLURM_NODEID": "2"}
    env.update(extra)
    return env


def test_slurm_env_gives_rank_world_master_from_first_host_and_job_port():
    launch = env_from_slurm(_slurm(SLURM_NTASKS_PER_NODE="2"))
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == \
        (5, 8, 1, 2)
    assert launch.master_addr == "cn12"
    assert launch.master_port == slurm_port(4242) == 20000 + 4242
    assert launch.source == "slurm"


def test_slurm_env_reads_heterogeneous_tasks_per_node_and_explicit_master():
    launch = env_from_slurm(_slurm(SLURM_TASKS_PER_NODE="3(x2),1,2", SLURM_NODEID="2",
                                   MASTER_ADDR="10.0.0.1", MASTER_PORT="1234"))
    assert launch.local_world_size == 1
    assert (launch.master_addr, launch.master_port) == ("10.0.0.1", 1234)
    # no per-node counts at all: an even split over the listed hosts
    assert env_from_slurm(_slurm()).local_world_size == 2


def test_slurm_port_is_the_same_for_every_task_and_in_range():
    ports = {slurm_port(j) for j in range(0, 100_000, 997)}
    assert all(20000 <= p < 40000 for p in ports) and len(ports) > 50


def test_torchrun_variables_take_precedence_over_slurm():
    env = _slurm(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="h0", MASTER_PORT="29400")
    launch = detect_launch(env)
    assert (launch.source, launch.rank, launch.world_size, launch.local_rank) == \
        ("torchrun", 3, 4, 1)
    assert (launch.master_addr, launch.master_port) == ("h0", 29400)
    assert detect_launch({}) is None


def test_init_comm_without_launcher_is_the_local_fake():
    comm = init_comm(5, env={})
    assert isinstance(comm, LocalComm)
    assert (comm.rank, comm.world_size, comm.is_main) == (0, 1, True)
    t = torch.arange(4, dtype=torch.int64)
    assert comm.all_reduce_sum(t) is t and t.tolist() == [0, 1, 2, 3]
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    assert comm.all_gather_object("x") == ["x"]
    comm.barrier()
    with pytest.raises(ValueError):
        comm.broadcast(t, src=1)
    with pytest.raises(ValueError):
        init_comm(0, env={})


def test_bitwise_differences_sees_sign_of_zero_dtype_and_one_ulp():
    a = {"w": torch.tensor([0.0, 1.0]), "m": [1.5, (2, "x")], "n": np.arange(3.0)}
    assert bitwise_differences(a, {"w": torch.tensor([0.0, 1.0]), "m": [1.5, (2, "x")],
                                   "n": np.arange(3.0)}) == []
    assert bitwise_differences(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert bitwise_differences(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    one = torch.tensor([1.0], dtype=torch.float64)
    assert bitwise_differences(one, torch.tensor([math.nextafter(1.0, 2.0)], dtype=torch.float64))
    assert bitwise_differences(0.1 + 0.2, 0.3)
    assert bitwise_differences({"a": 1}, {"b": 1})
    assert bitwise_differences([1, 2], (1, 2))
    assert bitwise_differences(float("nan"), float("nan")) == []


def test_submitit_jobs_get_torchruns_variables_from_submitits_own_helper(monkeypatch):
    from cluster_fl.distributed import export_submitit_env, launch_rank, torch_env_set

    job = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4249", "SLURM_ARRAY_JOB_ID": "4242",
           "SLURM_ARRAY_TASK_ID": "7", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[3-4]", "SLURM_PROCID": "5",
           "SLURM_LOCALID": "1"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in job.items():
        monkeypatch.setenv(key, value)
    env: dict[str, str] = {}
    assert export_submitit_env(env)
    port = env.pop("MASTER_PORT")
    assert env == {"MASTER_ADDR": "gpu3", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "4"}
    other: dict[str, str] = {}
    assert export_submitit_env(other) and other["MASTER_PORT"] == port  # every task agrees
    assert not export_submitit_env({**env, "MASTER_PORT": port})  # a launcher's are kept
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not export_submitit_env({})  # one task: nothing to rendezvous
    env["MASTER_PORT"] = port
    assert torch_env_set(env) and not torch_env_set({"SLURM_PROCID": "0"})
    assert launch_rank(env) == 5 and launch_rank({}) == 0
    assert launch_rank({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}) == 3
