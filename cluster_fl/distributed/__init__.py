"""The process boundary: the only package that imports ``torch.distributed``.

* :mod:`~cluster_fl.distributed.comm` -- the :class:`Comm` seam (real gloo/NCCL group, single-process
  fake), two timeouts (dead peer vs. waiting for the slowest rank);
* :mod:`~cluster_fl.distributed.launch` -- torchrun / SLURM / submitit environments -> :class:`LaunchEnv`;
* :mod:`~cluster_fl.distributed.parallelize` -- applied from outside the single-device model code:
  device placement, dtype policy, activation checkpointing, FSDP2 sharding of a
  client lane;
* :mod:`~cluster_fl.distributed.spawn` -- local multi-process runs and 1-vs-N parity checks for tests.
"""

from cluster_fl.distributed.comm import Comm, CommError, LocalComm, TorchComm, init_comm
from cluster_fl.distributed.launch import (LaunchEnv, detect_launch, env_from_slurm, env_from_torchrun,
                                    expand_nodelist, export_submitit_env, launch_rank,
                                    parse_nodelist, slurm_port,
                                    torch_env_set)
from cluster_fl.distributed.spawn import (RankFailure, SpawnError, bitwise_differences, free_port,
                                   run_parity, spawn)

__all__ = [
    "Comm", "CommError", "LaunchEnv", "LocalComm", "RankFailure", "SpawnError", "TorchComm",
    "bitwise_differences", "detect_launch", "env_from_slurm", "env_from_torchrun",
    "expand_nodelist", "free_port", "init_comm", "launch_rank", "run_parity", "slurm_port",
    "spawn", "export_submitit_env", "parse_nodelist", "torch_env_set",
]
