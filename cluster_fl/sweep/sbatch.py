"""Render ``slurm/torchrun.sbatch``: a multi-node torchrun array job for a grid, without submitit.

The submitit path (``cluster-fl grid --cluster slurm``) runs one process per rank. Large decoders
want ``torchrun`` instead (one launcher per node, rendezvous on the first node, a process group per
node for FSDP2). This module writes every run's resolved config to
``<out>/<experiment>/.grid/configs/<run_id>.yaml`` plus a manifest (one config path per line, line
k+1 for array index k) and fills the template: ``#SBATCH --array``, the grid's resources,
``--signal=B:USR2@<delay>`` and ``--requeue``. On USR2 the batch shell forwards SIGTERM to the
ranks (the engine checkpoints on SIGTERM) and requeues the array task, which resumes from its run
folder. Only the runs that are failed or missing are written into the manifest.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Sequence

from cluster_fl.config import dump_config
from cluster_fl.errors import UserError
from cluster_fl.sweep.gridspec import Grid, RunSpec

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "torchrun.sbatch"


def write_manifest(grid: Grid, specs: Sequence[RunSpec]) -> Path:
    """Write each run's resolved config and the manifest; return the manifest path."""
    folder = grid.root / ".grid" / "configs"
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for spec in specs:
        path = folder / f"{spec.run_id}.yaml"
        path.write_text(dump_config(spec.config))
        lines.append(str(path.resolve()))
    manifest = grid.root / ".grid" / "manifest.txt"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def render(grid: Grid, manifest: Path, n_runs: int, template: Path = TEMPLATE,
           python: str = "python") -> str:
    """The sbatch text for ``n_runs`` array tasks reading their config from ``manifest``."""
    r = grid.resources
    if r.runs_per_gpu > 1:
        raise UserError(f"resources.runs_per_gpu={r.runs_per_gpu}: the torchrun template runs "
                        "one run an array task; pack small runs with `cluster-fl grid --cluster "
                        "slurm` instead")
    optional = []
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(r, key):
            optional.append(f"#SBATCH --{key}={getattr(r, key)}")
    if r.mem_gb is not None:
        optional.append(f"#SBATCH --mem={int(r.mem_gb)}G")
    if r.gpus_per_task:
        optional.append(f"#SBATCH --gpus-per-node={r.gpus_per_task * r.tasks_per_node}")
    logs = grid.root / ".grid" / "slurm"
    logs.mkdir(parents=True, exist_ok=True)
    return string.Template(template.read_text()).substitute(
        job_name=f"cfl-{grid.experiment}",
        array=f"0-{n_runs - 1}%{min(n_runs, r.array_parallelism)}",
        nodes=r.nodes,
        # one torchrun launcher per node; it starts tasks_per_node ranks
        cpus_per_task=r.cpus_per_task * r.tasks_per_node,
        time_min=r.time_min,
        signal_delay_s=r.signal_delay_s,
        optional="\n".join(optional),
        log=str(logs / "%A_%a.out"),
        setup="\n".join(r.setup),
        nproc_per_node=r.tasks_per_node,
        manifest=str(manifest.resolve()),
        python=python,
    )
