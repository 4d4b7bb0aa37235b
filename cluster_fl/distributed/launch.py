"""Launch environments: where this process sits, read from torchrun or SLURM variables.

fairseq2's ``cluster.py`` idea: one file translates the launcher's environment (torchrun's
``RANK``/``WORLD_SIZE``/..., SLURM's ``SLURM_PROCID``/``SLURM_JOB_NODELIST``/..., submitit's
job environment) into one :class:`LaunchEnv`; the engine and the launchers ask it and never read
``os.environ`` themselves.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Mapping, MutableMapping

@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, read from torchrun or SLURM variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5, as
    SLURM itself does (``scontrol show hostnames``) when ``scontrol`` is installed, else with
    :func:`parse_nodelist` (the tests hold the two equal wherever scontrol is there)."""
    hosts = scontrol_hostnames(nodelist)
    return hosts if hosts is not None else parse_nodelist(nodelist)


def scontrol_hostnames(nodelist: str) -> list[str] | None:
    """``scontrol show hostnames NODELIST``, or None when scontrol is missing or refuses."""
    import shutil
    import subprocess

    exe = shutil.which("scontrol")
    if exe is None or not nodelist.strip():
        return None
    try:
        out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    hosts = out.stdout.split()
    return hosts if out.returncode == 0 and hosts else None


def parse_nodelist(nodelist: str) -> list[str]:
    """Our own reading of a SLURM host list, for machines without ``scontrol``.
    Zero padding follows the range start; several bracket groups in one name multiply out."""
    hosts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ValueError(f"bad SLURM node list {nodelist!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            item = nodelist[start:i].strip()
            if item:
                hosts.extend(_expand_host(item, nodelist))
            start = i + 1
    if depth != 0:
        raise ValueError(f"bad SLURM node list {nodelist!r}: unbalanced '['")
    return hosts


def _expand_host(item: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        return [item]
    values: list[str] = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad SLURM node list {whole!r}: range {part!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"bad SLURM node list {whole!r}: descending range {part!r}")
        values.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))
    head, tail = item[:m.start()], item[m.end():]
    return [h for v in values for h in _expand_host(head + v + tail, whole)]


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """``SLURM_TASKS_PER_NODE`` such as ``2(x3),1`` -> tasks on node ``node_id``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"bad SLURM tasks-per-node value {tasks_per_node!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[min(node_id, len(counts) - 1)]


def device_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """This rank's CUDA device among the ``visible`` ones (``torch.cuda.device_count()``, which
    follows ``CUDA_VISIBLE_DEVICES``), for the ways launchers hand out GPUs:

    * every task sees the node's GPUs (torchrun, ``--gpus-per-node``): ``cuda:LOCAL_RANK``;
    * each task gets its own (SLURM ``--gpus-per-task=1``: one entry in ``CUDA_VISIBLE_DEVICES``):
      ``cuda:0`` -- ``set_device(LOCAL_RANK)`` would fail for every local rank but the first;
    * fewer GPUs than local ranks, shared (several ranks per GPU, gloo -- NCCL refuses two ranks
      on one device): ranks packed evenly, ``LOCAL_RANK x visible // local ranks``.
    """
    if visible < 1:
        raise ValueError("no visible CUDA device")
    if not 0 <= local_rank < max(1, local_world_size):
        raise ValueError(f"local rank {local_rank} outside [0, {local_world_size})")
    if visible >= local_world_size:
        return local_rank
    return local_rank * visible // local_world_size


def visible_devices(env: Mapping[str, str] | None = None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as the launcher set it (None when unset), for messages."""
    return (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")


def cpu_mask() -> set[int]:
    """The CPUs this process may run on (its affinity mask: what srun --cpus-per-task, taskset or
    a cgroup leave it), not the machine's count."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def threads_per_rank(mine: set[int], peers: list[set[int]]) -> int:
    """Intra-op threads for a rank whose mask is ``mine`` among the masks of the ranks on its
    host (``peers``, itself included): its CPUs shared evenly with the ranks whose masks overlap
    it. Disjoint masks (srun binding each task): all of its own; one mask for every local rank
    (torchrun unbound, or under one srun task): CPUs / local ranks."""
    sharing = sum(1 for other in peers if other & mine) or 1
    return max(1, len(mine) // sharing)


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def single_process_env(env: Mapping[str, str], gpu: str | None = None) -> dict[str, str]:
    """``env`` for a run started as its own process inside a task that packs several
    (``resources.runs_per_gpu``): without the launcher's rank variables (torchrun's and SLURM's
    task ids), so the run is a world of one instead of rank 0 of the task's job -- several
    runs would otherwise rendezvous on the job's one port -- and, with ``gpu``, seeing only that
    GPU (``CUDA_VISIBLE_DEVICES``)."""
    drop = set(LAUNCHER_VARIABLES) | {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                       "SLURM_NODEID"}
    out = {k: v for k, v in env.items() if k not in drop}
    if gpu is not None:
        out["CUDA_VISIBLE_DEVICES"] = gpu
    return out


def task_gpus(count: int, env: Mapping[str, str] | None = None) -> list[str]:
    """The ids of the ``count`` GPUs this task was given, as ``CUDA_VISIBLE_DEVICES`` names
    them (``0..count-1`` when it is unset)."""
    visible = visible_devices(env)
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()][:count] or [str(i) for i in
                                                                              range(count)]
    return [str(i) for i in range(count)]


def split_cpus(cpus: set[int], parts: int) -> list[set[int]]:
    """``cpus`` dealt into ``parts`` disjoint, near-equal sets (in order); with fewer CPUs than
    parts, parts share them round-robin (never an empty set)."""
    ordered = sorted(cpus)
    if len(ordered) < parts:
        return [{ordered[i % len(ordered)]} for i in range(parts)]
    size, extra = divmod(len(ordered), parts)
    out, start = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(set(ordered[start:start + n]))
        start += n
    return out


def slurm_port(job_id: str | int) -> int:
    """A port in [20000, 40000) derived from the job id, so every task of a job agrees on it."""
    return 20000 + int(job_id) % 20000


def env_from_torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    """torchrun (or any launcher that sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    return LaunchEnv(rank=int(env["RANK"]), world_size=world,
                     local_rank=int(env.get("LOCAL_RANK", 0)),
                     local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
                     master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                     master_port=int(env.get("MASTER_PORT", 29500)), source="torchrun")


def env_from_slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    """One process per SLURM task (``srun python -m cluster_fl ...``)."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = expand_nodelist(nodelist) if nodelist else []
    addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    if "MASTER_PORT" in env:
        port = int(env["MASTER_PORT"])
    elif "SLURM_JOB_ID" in env:
        port = slurm_port(env["SLURM_JOB_ID"])
    else:
        port = 29500
    world = int(env["SLURM_NTASKS"])
    if "SLURM_NTASKS_PER_NODE" in env:
        local_world = _tasks_on_node(env["SLURM_NTASKS_PER_NODE"], 0)
    elif "SLURM_TASKS_PER_NODE" in env:
        local_world = _tasks_on_node(env["SLURM_TASKS_PER_NODE"], int(env.get("SLURM_NODEID", 0)))
    else:
        local_world = max(1, math.ceil(world / max(1, len(hosts))))
    return LaunchEnv(rank=int(env["SLURM_PROCID"]), world_size=world,
                     local_rank=int(env.get("SLURM_LOCALID", 0)), local_world_size=local_world,
                     master_addr=addr, master_port=port, source="slurm")


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """torchrun variables win (``srun torchrun`` sets both), then SLURM, else ``None``."""
    env = os.environ if env is None else env
    return env_from_torchrun(env) or env_from_slurm(env)


def torch_env_set(env: Mapping[str, str] | None = None) -> bool:
    """True when a launcher (torchrun, or a wrapper before us) already set torch's variables."""
    return env_from_torchrun(os.environ if env is None else env) is not None


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher set it (0 when launched alone)."""
    launch = detect_launch(env)
    return 0 if launch is None else launch.rank


def export_submitit_env(environ: MutableMapping[str, str] | None = None) -> bool:
    """Inside a multi-task submitit job, set the variables torchrun would set (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) with
    submitit's own :class:`submitit.helpers.TorchDistributedEnvironment` (the first host as
    master; the port from ``MASTER_PORT`` or drawn from the job id, so every task of a job agrees
    and two arrays on one node do not collide). Nothing is changed when a launcher already set
    them, outside a submitit job, or for a one-task job. ``CUDA_VISIBLE_DEVICES`` is left alone:
    :func:`device_index` places each rank. True when the variables were set."""
    from submitit.helpers import TorchDistributedEnvironment

    environ = os.environ if environ is None else environ
    if torch_env_set(environ):
        return False
    try:
        tde = TorchDistributedEnvironment()
    except RuntimeError:  # not inside a submitit job
        return False
    if tde.world_size <= 1:
        return False
    environ.update({"MASTER_ADDR": tde.master_addr, "MASTER_PORT": str(tde.master_port),
                    "RANK": str(tde.rank), "WORLD_SIZE": str(tde.world_size),
                    "LOCAL_RANK": str(tde.local_rank),
                    "LOCAL_WORLD_SIZE": str(tde.local_world_size)})
    return True


def local_ranks_command(nproc: int, cli_args: list[str], python: str | None = None) -> list[str]:
    """The command that runs ``cluster-fl CLI_ARGS`` as ``nproc`` ranks on this machine (torchrun,
    standalone rendezvous on a free port), e.g. ``local_ranks_command(2, ["train", "run.yaml"])``.
    The children read their layout from torchrun's variables (:func:`env_from_torchrun`)."""
    import sys

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={nproc}", "-m", "cluster_fl", *cli_args]
