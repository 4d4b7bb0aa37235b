"""``cluster-fl status GRID``: done / running / failed per cell of a grid, and why a run failed.

The judging (run folders first, the scheduler as supporting evidence) is
:mod:`cluster_fl.sweep.status`.
"""

from __future__ import annotations

import argparse
import json

from cluster_fl.sweep.gridspec import load_grid, run_folder
from cluster_fl.sweep.status import (STALE_S, failure_reason, format_states, grid_states,
                                     progress_text, read_registry, run_progress)


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
    registry = read_registry(grid)
    reasons = {s.run_id: failure_reason(grid, s, registry.get(s.run_id))
               for s, state in states if state == "failed"}
    progress = {s.run_id: run_progress(run_folder(s.config)) for s, state in states
                if state in ("running", "done", "failed")}
    if args.json:
        for spec, state in states:
            print(json.dumps({"run_id": spec.run_id, "cell": spec.cell, "seed": spec.seed,
                              "state": state, "folder": str(run_folder(spec.config)),
                              **progress.get(spec.run_id, {}),
                              "job": (registry.get(spec.run_id) or {}).get("job_id"),
                              **({"reason": reasons[spec.run_id]} if state == "failed" else {})}))
    else:
        print(f"grid {grid.experiment}: {grid.root}")
        print(format_states(states))
        for spec, state in states:
            if spec.run_id in progress and state != "failed":
                print(f"{state:<8} {spec.run_id}: {progress_text(progress[spec.run_id])}")
        for run_id, reason in reasons.items():
            print(f"failed {run_id}: {reason}")
    return 0
