"""``cluster-fl grid GRID``: expand a grid and submit what is missing with submitit.

One array job per grid, one task per cell x seed, resources from the grid (a request that no node
of the partition can satisfy is refused before submission, naming the resource). Each task is a
:class:`GridTask`, a submitit ``Checkpointable``. Preemption: the engine owns SIGUSR2/SIGTERM while
it trains, checkpoints at the round boundary and raises ``Preempted``; then

* the job still RUNNING (SIGUSR2 from ``--signal=USR2@signal_delay_s`` before the time limit, or
  ``scancel --signal=USR2``): the task requeues itself (``scontrol requeue``) as submitit would;
* the scheduler already stopping it (``scontrol requeue``, preemption, ``scancel``: the job is
  COMPLETING or PENDING when SIGTERM arrives): the task leaves without a result, since a second
  requeue would fail ("Job is pending execution") or bring a cancelled job back.

The requeued task calls the engine again, which resumes from the last atomic checkpoint in the run
folder. ``--wait`` and ``status`` judge a run by its folder's ``status.json``, with the scheduler's
state as supporting evidence (:mod:`cluster_fl.sweep.status`), never by a submitit result:
the first attempt of a requeued task is not the run. Idempotence comes from the run folders too:
only ``failed`` or ``missing`` runs are submitted; the job of each submitted run is recorded in
``<out>/<experiment>/.grid/jobs.json`` so a run still queued is not submitted twice.

``--cluster debug`` runs the tasks in this process one after the other; ``local`` runs them as
local processes (submitit ``LocalExecutor``), at most ``array_parallelism`` at a time.

``resources.runs_per_gpu`` N > 1 packs N runs on each GPU of a task (N runs a task on CPU), each
run its own ``cluster-fl train`` process, after ``plan`` has checked that they fit
(:mod:`cluster_fl.sweep.pack`); the registry records the task's job for each of its runs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from cluster_fl.config import Config, build_config, to_dict
from cluster_fl.distributed.launch import export_submitit_env
from cluster_fl.errors import UserError
from cluster_fl.progress import Tally
from cluster_fl.sweep.gridspec import Grid, Resources, RunSpec, expand, run_folder
from cluster_fl.sweep.pack import check_packing, pack_tasks
from cluster_fl.sweep.requeue import requeue
from cluster_fl.sweep import status as status_mod
from cluster_fl.sweep.status import RESUBMIT, grid_states, write_registry

TrainFn = Callable[[Config], Any]
CLUSTERS = ("local", "slurm", "debug")
POLL_S = 5.0  # at most this long between two looks of `--wait` at the run folders and squeue


def _engine_train(cfg: Config) -> Path:
    from cluster_fl.engine.train import run_training

    return Path(run_training(cfg))


class GridTask(Checkpointable):
    """One cell x seed: runs (or resumes) the training of one config; picklable, requeueable."""

    def __init__(self, config: dict[str, Any], train_fn: TrainFn | None = None):
        self.config = config
        self.train_fn = train_fn

    def __call__(self) -> str:
        export_submitit_env()
        cfg = build_config(self.config)
        try:
            return str((self.train_fn or _engine_train)(cfg))
        except Exception as exc:
            # The engine owns SIGTERM/SIGUSR2 while it trains: on a signal it checkpoints at the
            # round boundary and raises ``Preempted`` (matched by name so this module need not
            # import torch). Hand over to the requeue path, as submitit's own handler would.
            if type(exc).__name__ == "Preempted":
                requeue(self)
            else:
                _record_failure(cfg, exc)
            raise

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """Requeue the same task: the engine checkpoints atomically every round and on start
        resumes from the run folder, so no state needs to travel with the task."""
        return DelayedSubmission(self, *args, **kwargs)


def _record_failure(cfg: Config, exc: Exception) -> None:
    """Mark the run folder failed with the error (rank 0, unless the run already finished), as
    ``cluster-fl train`` does, so ``status`` can say why without reading logs."""
    from cluster_fl.distributed.launch import launch_rank

    folder = run_folder(cfg)
    if type(exc).__name__ == "RunLocked":  # a second writer was refused: the live run is fine
        return
    if launch_rank() != 0 or not folder.is_dir():
        return
    from cluster_fl.engine.rundir import write_status

    status = status_mod.read_status(folder) or {}
    if status.get("state") != "done":
        write_status(folder, "failed", status.get("round", 0), cfg.fl.rounds,
                     error=f"{type(exc).__name__}: {exc}")


def check_resources(grid: Grid) -> None:
    """Refuse a request that no node of the partition can ever satisfy, naming the resource:
    SLURM would queue it forever (CPUs, nodes) or refuse it without saying which key is wrong."""
    nodes = status_mod.slurm_nodes(grid.resources.partition)
    if nodes is None:  # sinfo cannot answer: let sbatch decide
        return
    r = grid.resources
    where = f"partition {r.partition}" if r.partition else "the default partition"
    if not nodes:
        raise UserError(f"resources.partition: {where} has no nodes (or does not exist)")
    most = {k: max(n[k] for n in nodes) for k in ("cpus", "gpus", "mem_mb")}
    per_node = f" ({r.tasks_per_node} tasks per node)" if r.tasks_per_node > 1 else ""
    checks = [  # key, asked, largest available, unit
        ("nodes", r.nodes, len(nodes), "nodes"),
        ("cpus_per_task", r.cpus_per_task * r.tasks_per_node, most["cpus"], "CPUs per node" + per_node),
        ("gpus_per_task", r.gpus_per_task * r.tasks_per_node, most["gpus"], "GPUs per node" + per_node),
    ]
    if r.mem_gb is not None:
        checks.append(("mem_gb", int(r.mem_gb * 1024), most["mem_mb"], "MB of memory per node"))
    for key, asked, available, unit in checks:
        if asked > available:
            raise UserError(f"resources.{key}={getattr(r, key)} asks for {asked} {unit}, but "
                            f"{where} has at most {available}; no node can ever run it")


def check_devices(grid: Grid, specs: Sequence[RunSpec], cluster: str) -> list[str]:
    """No silent CPU: refuse a grid whose cells ask for a GPU the task does not request, and
    return warnings (one line each) for cells that would quietly train on CPU on a machine or
    partition that has GPUs. Called before anything is submitted (and by ``--dry-run``)."""
    r = grid.resources
    devices = {spec.config.run.device for spec in specs}
    if "cuda" in devices and r.gpus_per_task == 0:
        cell = next(s.cell for s in specs if s.config.run.device == "cuda")
        raise UserError(f"run.device=cuda (cell {cell}) with resources.gpus_per_task=0: the task "
                        "would be given no GPU and fail at its start; set resources.gpus_per_task "
                        "(or run.device=cpu)")
    if "auto" not in devices or r.gpus_per_task > 0 or cluster == "debug":
        return []
    if cluster == "slurm":
        nodes = status_mod.slurm_nodes(r.partition)
        has_gpus = bool(nodes) and any(n["gpus"] for n in nodes)
        where = f"partition {r.partition}" if r.partition else "the default partition"
    else:
        import torch

        has_gpus = torch.cuda.is_available()
        where = "this machine"
    if not has_gpus:
        return []
    cell = next(s.cell for s in specs if s.config.run.device == "auto")
    return [f"warning: run.device=auto (cell {cell}) with resources.gpus_per_task=0 on {where}, "
            "which has GPUs: the runs get no GPU and train on CPU; set resources.gpus_per_task "
            "for GPUs or run.device=cpu to say CPU"]


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
            # since SLURM 22.05 srun does not inherit sbatch's --cpus-per-task: without it each
            # task is bound to one CPU
            "slurm_srun_args": [f"--cpus-per-task={r.cpus_per_task}"],
        })
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(r, key):
                params[f"slurm_{key}"] = getattr(r, key)
        if r.setup:
            params["slurm_setup"] = list(r.setup)
    return params


def make_executor(grid: Grid, cluster: str) -> submitit.AutoExecutor:
    """A submitit executor for the grid, logging to ``<out>/<experiment>/.grid/logs/<job>_<task>_log.err``
    (and ``.out``): one flat folder, no ``%j`` folder that submitit's array submission leaves
    unexpanded; the registry records each run's log file."""
    if cluster not in CLUSTERS:
        raise UserError(f"--cluster must be one of {', '.join(CLUSTERS)}, got {cluster!r}")
    folder = grid.root / ".grid" / "logs"
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    except RuntimeError as exc:  # e.g. no srun on PATH for --cluster slurm
        raise UserError(f"cannot use --cluster {cluster}: {exc}") from None
    executor.update_parameters(**executor_parameters(grid, cluster))
    return executor


def pending_runs(grid: Grid, extra: dict[str, Any] | None = None
                 ) -> tuple[list[RunSpec], list[tuple[RunSpec, str]]]:
    """The runs to submit (failed or missing) and every run's current state."""
    states = grid_states(grid, expand(grid, extra))
    return [s for s, state in states if state in RESUBMIT], states


def seed_major(specs: Sequence[RunSpec]) -> list[RunSpec]:
    """``specs`` with every cell's first seed first, then every cell's second, ...: waves (local),
    an array's %N (SLURM) and packs start whole seeds, so a grid stopped part way (a budget, a
    session's end) leaves a paired comparison of every method rather than one method's seeds."""
    order = {seed: i for i, seed in enumerate(dict.fromkeys(s.seed for s in specs))}
    return sorted(specs, key=lambda s: order[s.seed])  # stable: cells keep the grid's order


def submit(grid: Grid, specs: Sequence[RunSpec], cluster: str, train_fn: TrainFn | None = None,
           wait: bool = False, poll_s: float = POLL_S) -> tuple[list[Any], dict[str, str]]:
    """Submit ``specs`` as one array job (in waves of ``array_parallelism`` on ``local``); record
    each run's job in the registry. ``debug`` runs them now; ``wait`` blocks until all end.
    Returns the jobs and, for the runs waited for, ``run id -> reason`` of those that failed."""
    if not specs:
        return [], {}
    specs = seed_major(specs)
    for line in check_devices(grid, specs, cluster):
        print(line, file=sys.stderr, flush=True)
    if cluster == "slurm":
        check_resources(grid)
    if grid.resources.runs_per_gpu > 1:  # several runs a task (their own processes)
        for line in check_packing(grid, specs):
            print(line, file=sys.stderr, flush=True)
        units = pack_tasks(grid, specs)
    else:
        units = [([s], GridTask(to_dict(s.config), train_fn)) for s in specs]
    executor = make_executor(grid, cluster)
    if cluster == "slurm":  # features first, on CPUs, when a store is not full
        _after_features(grid, specs, executor)
    for spec in specs:  # the engine owns the folder; create it so logs have a home early
        run_folder(spec.config).parent.mkdir(parents=True, exist_ok=True)
    wave = grid.resources.array_parallelism if cluster == "local" else len(units)
    jobs: list[Any] = []
    failed: dict[str, str] = {}
    for start in range(0, len(units), wave):
        chunk_units = units[start:start + wave]
        chunk_specs = [spec for group, _ in chunk_units for spec in group]
        chunk = _submit_array(executor, [task for _, task in chunk_units], cluster)
        write_registry(grid, {
            spec.run_id: {"cluster": cluster, "job_id": str(job.job_id), "host": socket.gethostname(),
                          "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
                          "log": str(job.paths.stderr)}
            for (group, _), job in zip(chunk_units, chunk) for spec in group})
        link_logs(grid, chunk_units, chunk)
        jobs.extend(chunk)
        # debug jobs run only when their result is asked for; local waves throttle the machine
        more = start + wave < len(units)
        if wait or cluster == "debug" or (cluster == "local" and more):
            failed.update(wait_for_runs(grid, chunk_specs, chunk, cluster, poll_s))
    return jobs, failed


def link_logs(grid: Grid, units: Sequence[tuple[Sequence[RunSpec], Any]], jobs: Sequence[Any]) -> None:
    """``.grid/logs/<run_id>.err`` / ``.out``: links named after each run to its job's log files
    (a packed task's runs share one), so a run's log is found by its name."""
    folder = grid.root / ".grid" / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    for (group, _), job in zip(units, jobs):
        for spec in group:
            for suffix, target in ((".err", job.paths.stderr), (".out", job.paths.stdout)):
                link = folder / f"{spec.run_id}{suffix}"
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(Path(target).name)  # relative: the folder can move


def _after_features(grid: Grid, specs: Sequence[RunSpec], executor: Any) -> None:
    """Submit the features array job when the runs' store is not full and make the training
    array wait for it (:mod:`cluster_fl.sweep.features_job`)."""
    from cluster_fl.sweep.features_job import submit_features

    def make(params: dict[str, Any]) -> Any:
        features = submitit.AutoExecutor(folder=grid.root / ".grid" / "logs",  # as the runs
                                         cluster="slurm")
        features.update_parameters(**params)
        return features

    try:
        job = submit_features(grid, specs, make)
    except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError, OSError,
            RuntimeError) as exc:
        raise UserError(f"--cluster slurm: the features job's submission failed: "
                        f"{_submission_reason(exc)}") from None
    if job is not None:
        extra = dict(executor_parameters(grid, "slurm")["slurm_additional_parameters"])
        executor.update_parameters(slurm_additional_parameters={**extra,
                                                                 "dependency": f"afterok:{job}"})
        print(f"features: job {job} fills the store first; the runs wait for it", flush=True)


def _submit_array(executor: Any, tasks: list[Any], cluster: str) -> list[Any]:
    """``executor.submit_array``, a refusal (sbatch's error, a scheduler that went away) as one
    line naming the cluster instead of submitit's traceback."""
    try:
        return executor.submit_array(tasks)
    except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError, OSError,
            RuntimeError) as exc:
        raise UserError(f"--cluster {cluster}: the submission failed: "
                        f"{_submission_reason(exc)}") from None


def _submission_reason(exc: BaseException) -> str:
    """sbatch's own error line out of a failed submission (else the first line)."""
    text = str(getattr(exc, "stderr", None) or exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else
                type(exc).__name__)


def wait_for_runs(grid: Grid, specs: Sequence[RunSpec], jobs: Sequence[Any], cluster: str,
                  poll_s: float = POLL_S) -> dict[str, str]:
    """Block until no run of ``specs`` is pending or running, judged from the run folders and the
    scheduler's liveness (never from submitit results, which a requeued task's first attempt may
    have left as an error); print and return ``run id -> reason`` for each run that did not finish."""
    if cluster == "debug":
        for job in jobs:  # runs the task in this process; its folder says how it ended
            try:
                job.result()
            except Exception:  # noqa: BLE001 -- one failed run must not stop the grid
                pass
    delay = min(0.2, poll_s)
    tally = Tally(len(specs), f"grid {grid.experiment}")  # a bar on a terminal, lines elsewhere
    while True:
        states = status_mod.grid_states_of(list(specs), status_mod.read_registry(grid))
        count = Counter(state for _, state in states)
        tally.update(count["done"] + count["failed"] + count["missing"],
                     ", ".join(f"{count[k]} {k}" for k in status_mod.STATES if count[k]))
        if not any(state in ("pending", "running") for _, state in states):
            break
        time.sleep(delay)
        delay = min(delay * 1.5, poll_s)
    tally.close()
    registry = status_mod.read_registry(grid)
    failed = {}
    for spec, state in states:
        if state != "done":
            failed[spec.run_id] = status_mod.failure_reason(grid, spec, registry.get(spec.run_id))
            print(f"run {spec.run_id} failed: {failed[spec.run_id]}", flush=True)
    return failed
