"""Where each run of a grid stands, and the ``cluster-fl status GRID`` command.

A run's state comes from two places: its folder's ``status.json`` (written by the engine) and the
grid's job registry ``<out>/<experiment>/.grid/jobs.json`` (written by ``grid`` at submission: which
scheduler job runs which run id). The decision ``grid`` makes from it:

=========  ===================================================================  ==========
state      meaning                                                              resubmit?
=========  ===================================================================  ==========
done       status.json says done                                                no
running    status.json says running and its job is alive (or, with no job        no
           record, its heartbeat is younger than ``stale_s``)
pending    no status.json yet, but its job is alive (queued, starting)           no
failed     status.json says failed, or running with a dead job / stale beat     yes
missing    no run folder status and no live job                                 yes
=========  ===================================================================  ==========
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

from cluster_fl.experiments.gridspec import Grid, RunSpec, expand, load_grid, run_folder

STATES = ("done", "running", "pending", "failed", "missing")
RESUBMIT = ("failed", "missing")
# squeue states of a job that still holds (or will get) a slot
SLURM_LIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
              "REQUEUE_FED", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED"}
STALE_S = 3600.0


def registry_path(grid: Grid) -> Path:
    """The grid's job registry: run id -> {cluster, job_id, host, submitted}."""
    return grid.root / ".grid" / "jobs.json"


def read_registry(grid: Grid) -> dict[str, dict[str, Any]]:
    """The job registry (empty when nothing was submitted yet)."""
    path = registry_path(grid)
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def write_registry(grid: Grid, records: Mapping[str, Mapping[str, Any]]) -> None:
    """Merge ``records`` into the registry, atomically (tmp file + rename)."""
    path = registry_path(grid)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**read_registry(grid), **records}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_status(folder: Path) -> dict[str, Any] | None:
    """A run folder's ``status.json`` or None (absent or half-written)."""
    try:
        return json.loads((folder / "status.json").read_text())
    except (OSError, ValueError):
        return None


def job_alive(record: Mapping[str, Any] | None) -> bool | None:
    """Is the scheduler job of a registry record still alive? None when it cannot be told."""
    if not record:
        return None
    cluster, job_id = record.get("cluster"), str(record.get("job_id"))
    if cluster == "slurm":
        try:
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                                 text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode != 0:  # squeue forgets finished jobs: "Invalid job id"
            return False if "nvalid job id" in out.stderr else None
        return any(s.strip() in SLURM_LIVE for s in out.stdout.split())
    if cluster == "local":
        if record.get("host") != socket.gethostname():
            return None
        import psutil

        try:
            return psutil.Process(int(job_id)).status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, ValueError):
            return False
    return False  # debug jobs run in-process and are over when `grid` returns


def _age_s(status: Mapping[str, Any]) -> float:
    try:
        updated = dt.datetime.fromisoformat(str(status["updated"]))
    except (KeyError, ValueError):
        return float("inf")
    now = dt.datetime.now(updated.tzinfo) if updated.tzinfo else dt.datetime.now()
    return (now - updated).total_seconds()


def run_state(spec: RunSpec, registry: Mapping[str, Mapping[str, Any]],
              stale_s: float = STALE_S) -> str:
    """One of ``STATES`` for a run (see the module docstring for the rules)."""
    status = read_status(run_folder(spec.config))
    state = (status or {}).get("state")
    if state == "done":
        return "done"
    alive = job_alive(registry.get(spec.run_id))
    if alive:
        return "running" if status else "pending"
    if status is None:
        return "missing"
    if state == "running" and alive is None and _age_s(status) < stale_s:
        return "running"
    return "failed"


def grid_states(grid: Grid, specs: list[RunSpec] | None = None,
                stale_s: float = STALE_S) -> list[tuple[RunSpec, str]]:
    """``(spec, state)`` for every run of a grid."""
    registry = read_registry(grid)
    return [(s, run_state(s, registry, stale_s)) for s in (specs or expand(grid))]


def format_states(states: list[tuple[RunSpec, str]]) -> str:
    """A per-cell table: counts per state and which seeds are in which state."""
    cells: dict[str, list[tuple[int, str]]] = {}
    for spec, state in states:
        cells.setdefault(spec.cell, []).append((spec.seed, state))
    width = max([len(c) for c in cells] + [4])
    lines = [f"{'cell':<{width}}  " + "  ".join(f"{s:>7}" for s in STATES) + "  seeds"]
    for cell, runs in cells.items():
        count = Counter(state for _, state in runs)
        seeds = " ".join(f"s{seed}:{state}" for seed, state in runs)
        lines.append(f"{cell:<{width}}  " + "  ".join(f"{count[s]:>7}" for s in STATES) + f"  {seeds}")
    total = Counter(state for _, state in states)
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{total[s]:>7}" for s in STATES)
                 + f"  ({len(states)} runs)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("grid", help="grid YAML (configs/grids/*.yaml)")
    parser.add_argument("--out", default=None, help="results root (default: the grid's 'out')")
    parser.add_argument("--stale-after", type=float, default=STALE_S,
                        help="seconds without a heartbeat before a running run with no job "
                             "record counts as failed")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")


def run(args: argparse.Namespace) -> int:
    grid = load_grid(args.grid, out=args.out)
    states = grid_states(grid, stale_s=args.stale_after)
    if args.json:
        for spec, state in states:
            print(json.dumps({"run_id": spec.run_id, "cell": spec.cell, "seed": spec.seed,
                              "state": state, "folder": str(run_folder(spec.config))}))
    else:
        print(f"grid {grid.experiment}: {grid.root}")
        print(format_states(states))
    return 0
