"""Several runs in one allocation (``resources.runs_per_gpu``): small runs share a GPU.

A tiny run peaks at a few GiB of a 141 GiB GPU, so a grid of them wastes the device one run at a
time. With ``runs_per_gpu`` N, each scheduler task (its GPUs, CPUs and memory: the grid's
``resources``) runs N runs on every GPU it is given -- N x max(1, gpus_per_task) runs a task --
each as its own ``cluster-fl train`` process:

* **GPU**: run k sees only GPU k // N of the task (``CUDA_VISIBLE_DEVICES``), so N runs share a
  device; on CPU (``gpus_per_task: 0``) N runs share the task's CPUs, which is how this is tested;
* **CPUs**: the task's CPUs (its affinity mask) are dealt into disjoint sets, one per run, and
  each run is pinned to its set, so a run's threads (``run.threads: 0`` = its mask) do not
  oversubscribe the others';
* **launcher variables** are removed from each run's environment (each is a world of one, not
  rank 0 of the task's job);
* **memory**, checked before anything is submitted (:func:`check_packing`): ``cluster-fl plan``'s
  figure for one run (one GPU, the config's checkpointing setting) x N must fit
  ``resources.gpu_memory_gb`` (GPU tasks: required) or ``resources.mem_gb`` (CPU tasks, when
  given).

Preemption: the task forwards SIGTERM / SIGUSR2 to its runs as SIGTERM (each checkpoints and
exits 75) and, when any of them was stopped so, requeues the whole task like a single run's task
does; runs already finished are skipped when it starts again. A run that fails records why in its
own folder (``status``); the others carry on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from cluster_fl.config import Config, build_config, dump_config, to_dict
from cluster_fl.distributed.launch import cpu_mask, single_process_env, split_cpus, task_gpus
from cluster_fl.errors import PREEMPTED_EXIT, UserError
from cluster_fl.sweep.gridspec import Grid, RunSpec
from cluster_fl.sweep.requeue import requeue

GIB = 1024 ** 3


def runs_per_task(grid: Grid) -> int:
    """How many runs one task holds: N per GPU it has (N on CPU)."""
    r = grid.resources
    return r.runs_per_gpu * max(1, r.gpus_per_task)


def packs(grid: Grid, specs: Sequence[RunSpec]) -> list[list[RunSpec]]:
    """``specs`` in task-sized groups, in order."""
    n = runs_per_task(grid)
    return [list(specs[i:i + n]) for i in range(0, len(specs), n)]


def check_packing(grid: Grid, specs: Sequence[RunSpec]) -> list[str]:
    """Refuse (UserError naming the keys) a pack that ``plan`` says does not fit its memory;
    return the plan's figures as lines for the user. Nothing to check with one run a GPU."""
    from cluster_fl.sizing.plan import plan

    r = grid.resources
    n = r.runs_per_gpu
    if n == 1 or not specs:
        return []
    gpu = r.gpus_per_task > 0
    if gpu and r.gpu_memory_gb is None:
        raise UserError(f"resources.runs_per_gpu={n} needs resources.gpu_memory_gb (the memory "
                        "of one GPU, e.g. 80 or 141) so that `cluster-fl plan` can check that "
                        f"{n} runs fit on it")
    memory = r.gpu_memory_gb if gpu else r.mem_gb  # per GPU; per task (the runs share it)
    if memory is None:
        return [f"runs_per_gpu={n} on CPU: resources.mem_gb is not set, memory not checked"]
    lines, seen = [], {}
    for spec in specs:
        cfg = spec.config
        key = json.dumps({"model": to_dict(cfg)["model"], "batch": cfg.fl.batch_size,
                          "mels": cfg.data.n_mels}, sort_keys=True)
        if key in seen:
            continue
        result = plan(cfg, 1, memory, device="cuda" if gpu else "cpu")
        row = result["rows"][0][result["uses"]]
        seen[key] = row["total_bytes"]
        need = n * row["total_bytes"]
        where = (f"resources.gpu_memory_gb={r.gpu_memory_gb:g}" if gpu
                 else f"resources.mem_gb={r.mem_gb:g}")
        line = (f"plan: cell {spec.cell}: {row['total_bytes'] / GIB:.2f} GiB a run x "
                f"runs_per_gpu {n} = {need / GIB:.2f} GiB of {memory:g} GiB")
        if need > memory * GIB:
            raise UserError(f"resources.runs_per_gpu={n}: {line.removeprefix('plan: ')} "
                            f"({where}); lower runs_per_gpu or give the task more memory")
        lines.append(line)
    return lines


class GridPack:
    """One task of a packed grid: several runs side by side (picklable, requeueable like
    :class:`~cluster_fl.sweep.grid.GridTask`)."""

    def __init__(self, configs: list[dict[str, Any]], runs_per_gpu: int, gpus: int,
                 folder: str, poll_s: float = 0.5):
        self.configs, self.runs_per_gpu, self.gpus = configs, runs_per_gpu, gpus
        self.folder, self.poll_s = folder, poll_s

    def __call__(self) -> dict[str, int]:
        cfgs = [build_config(c) for c in self.configs]
        slots = self.slots(len(cfgs))
        procs = [self._start(cfg, slot) for cfg, slot in zip(cfgs, slots)]
        stop = {"signal": None}

        def forward(signum: int, _frame: Any) -> None:
            stop["signal"] = signum
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # the engine checkpoints on SIGTERM

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR2)}
        try:
            while any(p.poll() is None for p in procs):
                time.sleep(self.poll_s)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        codes = {str(cfg.run.run_id): p.returncode for cfg, p in zip(cfgs, procs)}
        self._record(cfgs, slots, procs)
        if any(code == PREEMPTED_EXIT for code in codes.values()):
            requeue(self)  # requeues the whole task (finished runs are skipped on restart)
            raise SystemExit(PREEMPTED_EXIT)
        failed = {run: code for run, code in codes.items() if code != 0}
        if failed:
            raise RuntimeError(f"runs failed (exit codes): {failed}; their folders say why")
        return codes

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)

    def slots(self, n: int) -> list[dict[str, Any]]:
        """Each run's GPU (None on CPU) and CPU set: runs k*N..k*N+N-1 share GPU k."""
        gpus = task_gpus(self.gpus) if self.gpus else []
        cpus = split_cpus(cpu_mask(), n)
        return [{"gpu": gpus[i // self.runs_per_gpu] if gpus else None, "cpus": sorted(cpus[i])}
                for i in range(n)]

    def _start(self, cfg: Config, slot: dict[str, Any]) -> subprocess.Popen:
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{cfg.run.run_id}.yaml"
        path.write_text(dump_config(cfg))
        env = single_process_env(os.environ, slot["gpu"])
        cpus = set(slot["cpus"])
        log = open(folder / f"{cfg.run.run_id}.log", "ab")  # noqa: SIM115 -- the child's
        return subprocess.Popen([sys.executable, "-m", "cluster_fl", "train", str(path)],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus))

    def _record(self, cfgs: list[Config], slots: list[dict[str, Any]],
                procs: list[subprocess.Popen]) -> None:
        """``<folder>/pack-<pid>.json``: where each run ran and how it ended."""
        record = [{"run_id": cfg.run.run_id, **slot, "exit": p.returncode}
                  for cfg, slot, p in zip(cfgs, slots, procs)]
        (Path(self.folder) / f"pack-{os.getpid()}.json").write_text(json.dumps(record, indent=1))


def pack_tasks(grid: Grid, specs: Sequence[RunSpec]) -> list[tuple[list[RunSpec], GridPack]]:
    """(the runs, their task) for every pack of ``specs``."""
    r = grid.resources
    folder = str(grid.root / ".grid" / "packs")
    return [(group, GridPack([to_dict(s.config) for s in group], r.runs_per_gpu,
                             r.gpus_per_task, folder)) for group in packs(grid, specs)]
