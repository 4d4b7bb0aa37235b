"""``cluster-fl grid GRID``: expand a grid and submit what is missing with submitit.

One array job per grid, one task per cell x seed, resources from the grid. Each task is a
:class:`GridTask`, a submitit ``Checkpointable``: on preemption or timeout SLURM sends USR2
(``signal_delay_s`` before the kill), submitit calls :meth:`GridTask.checkpoint`, which returns the
same task, and requeues the job (``scontrol requeue``); the requeued task calls the engine again,
which resumes from the last atomic checkpoint in the run folder. Idempotence comes from the run
folders: before submitting, every run's state is read (:mod:`cluster_fl.experiments.status`) and
only ``failed`` or ``missing`` runs are submitted; the job of each submitted run is recorded in
``<out>/<experiment>/.grid/jobs.json`` so a run still queued is not submitted twice.

``--cluster debug`` runs the tasks in this process one after the other; ``local`` runs them as
local processes (submitit ``LocalExecutor``), at most ``array_parallelism`` at a time.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from cluster_fl.config import Config, build_config, parse_override, to_dict
from cluster_fl.dist.launch import submitit_torch_env
from cluster_fl.errors import UserError
from cluster_fl.experiments.gridspec import Grid, Resources, RunSpec, expand, load_grid, run_folder
from cluster_fl.experiments.status import RESUBMIT, format_states, grid_states, write_registry

TrainFn = Callable[[Config], Any]
CLUSTERS = ("local", "slurm", "debug")


def _engine_train(cfg: Config) -> Path:
    from cluster_fl.engine.train import run_training

    return Path(run_training(cfg))


def _export_torch_env() -> None:
    """Translate a multi-task submitit/SLURM job into the variables torch.distributed reads
    (what torchrun would set), unless a launcher already set them."""
    if "RANK" in os.environ:
        return
    try:
        env = submitit.JobEnvironment()
    except RuntimeError:  # not inside a submitit job
        return
    if env.num_tasks <= 1:
        return
    os.environ.update(submitit_torch_env(env))


class GridTask(Checkpointable):
    """One cell x seed: runs (or resumes) the training of one config; picklable, requeueable."""

    def __init__(self, config: dict[str, Any], train_fn: TrainFn | None = None):
        self.config = config
        self.train_fn = train_fn

    def __call__(self) -> str:
        _export_torch_env()
        cfg = build_config(self.config)
        try:
            return str((self.train_fn or _engine_train)(cfg))
        except Exception as exc:
            # The engine owns SIGTERM/SIGUSR2 while it trains: on a signal it checkpoints at the
            # round boundary and raises ``Preempted`` (matched by name so this module need not
            # import torch). Hand over to submitit's requeue path, as its own handler would.
            if type(exc).__name__ == "Preempted":
                _requeue(self)
            raise

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """Requeue the same task: the engine checkpoints atomically every round and on start
        resumes from the run folder, so no state needs to travel with the task."""
        return DelayedSubmission(self, *args, **kwargs)


def _requeue(task: GridTask) -> None:
    """Checkpoint ``task`` into the job's pickle and requeue the job (exits the process);
    returns only when not inside a requeueable submitit job."""
    from submitit.core.job_environment import SignalHandler

    try:
        env = submitit.JobEnvironment()
    except RuntimeError:
        return
    if env.cluster not in ("slurm", "local"):
        return
    delayed = DelayedSubmission.load(env.paths.submitted_pickle)
    delayed.function = task
    SignalHandler(env, env.paths, delayed).checkpoint_and_try_requeue(signal.SIGUSR2)


def executor_parameters(grid: Grid, cluster: str) -> dict[str, Any]:
    """submitit parameters for a grid's resources (generic + ``slurm_`` ones)."""
    r: Resources = grid.resources
    params: dict[str, Any] = {
        "name": f"cfl-{grid.experiment}",
        "timeout_min": r.time_min,
        "nodes": r.nodes,
        "tasks_per_node": r.tasks_per_node,
        "cpus_per_task": r.cpus_per_task,
    }
    if r.gpus_per_task:
        params["gpus_per_node"] = r.gpus_per_task * r.tasks_per_node
    if r.mem_gb is not None:
        params["mem_gb"] = r.mem_gb
    if cluster == "slurm":
        params.update({
            "slurm_array_parallelism": r.array_parallelism,
            "slurm_signal_delay_s": r.signal_delay_s,
            "slurm_additional_parameters": {"requeue": True},
        })
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(r, key):
                params[f"slurm_{key}"] = getattr(r, key)
        if r.setup:
            params["slurm_setup"] = list(r.setup)
    return params


def make_executor(grid: Grid, cluster: str) -> submitit.AutoExecutor:
    """A submitit executor for the grid, logging under ``<out>/<experiment>/.grid/submitit``."""
    if cluster not in CLUSTERS:
        raise UserError(f"--cluster must be one of {', '.join(CLUSTERS)}, got {cluster!r}")
    folder = grid.root / ".grid" / "submitit" / "%j"
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    except RuntimeError as exc:  # e.g. no srun on PATH for --cluster slurm
        raise UserError(f"cannot use --cluster {cluster}: {exc}") from None
    executor.update_parameters(**executor_parameters(grid, cluster))
    return executor


def plan(grid: Grid, extra: dict[str, Any] | None = None) -> tuple[list[RunSpec], list[tuple[RunSpec, str]]]:
    """The runs to submit (failed or missing) and every run's current state."""
    states = grid_states(grid, expand(grid, extra))
    return [s for s, state in states if state in RESUBMIT], states


def submit(grid: Grid, specs: Sequence[RunSpec], cluster: str, train_fn: TrainFn | None = None,
           wait: bool = False) -> list[Any]:
    """Submit ``specs`` as one array job (in waves of ``array_parallelism`` on ``local``); record
    each run's job in the registry. ``debug`` runs them now; ``wait`` blocks until all finish."""
    if not specs:
        return []
    executor = make_executor(grid, cluster)
    tasks = [GridTask(to_dict(s.config), train_fn) for s in specs]
    for spec in specs:  # the engine owns the folder; create it so logs have a home early
        run_folder(spec.config).parent.mkdir(parents=True, exist_ok=True)
    wave = grid.resources.array_parallelism if cluster == "local" else len(tasks)
    jobs: list[Any] = []
    for start in range(0, len(tasks), wave):
        chunk = executor.submit_array(tasks[start:start + wave])
        write_registry(grid, {
            spec.run_id: {"cluster": cluster, "job_id": str(job.job_id), "host": socket.gethostname(),
                          "submitted": time.strftime("%Y-%m-%dT%H:%M:%S")}
            for spec, job in zip(specs[start:start + wave], chunk)})
        jobs.extend(chunk)
        # debug jobs run only when their result is asked for; local waves throttle the machine
        more = start + wave < len(tasks)
        if wait or cluster == "debug" or (cluster == "local" and more):
            _wait(chunk, specs[start:start + wave])
    return jobs


def _wait(jobs: Sequence[Any], specs: Sequence[RunSpec]) -> None:
    """Block until the jobs end; a failing run is reported, not raised (its folder says failed)."""
    for job, spec in zip(jobs, specs):
        try:
            job.result()
        except Exception as exc:  # noqa: BLE001 -- one failed run must not stop the grid
            print(f"run {spec.run_id} failed: {str(exc).strip().splitlines()[-1] if str(exc) else exc!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("grid", help="grid YAML (configs/grids/*.yaml)")
    parser.add_argument("--cluster", choices=CLUSTERS, default="local",
                        help="slurm: one array job; local: local processes; debug: in this process")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, submit nothing")
    parser.add_argument("--wait", action="store_true", help="block until the submitted runs end")
    parser.add_argument("--out", default=None, help="results root (default: the grid's 'out')")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="key=value",
                        help="override for every run (repeatable), e.g. --set fl.rounds=2")


def run(args: argparse.Namespace, train_fn: TrainFn | None = None) -> int:
    grid = load_grid(args.grid, out=args.out)
    extra = dict(parse_override(o) for o in args.overrides)
    todo, states = plan(grid, extra)
    print(f"grid {grid.experiment}: {len(states)} runs under {grid.root}")
    print(format_states(states))
    if args.dry_run:
        for spec in todo:
            axes = " ".join(f"{k}={v}" for k, v in spec.axes.items())
            print(f"would submit {spec.run_id}  ({axes} seed={spec.seed}) -> {run_folder(spec.config)}")
        print(f"dry run: {len(todo)} of {len(states)} runs would be submitted to {args.cluster}")
        return 0
    jobs = submit(grid, todo, args.cluster, train_fn=train_fn, wait=args.wait)
    ids = sorted({str(j.job_id).split("_")[0] for j in jobs})
    print(f"submitted {len(jobs)} runs to {args.cluster}" + (f" (job {', '.join(ids)})" if ids else ""))
    return 0
