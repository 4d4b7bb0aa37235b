"""``cluster-fl grid GRID [--cluster local|slurm|debug] [--dry-run] [--wait] [--round0]
[--parallel N]``: submit a grid.

Expansion, submission with submitit, waiting and the run-folder bookkeeping are
:mod:`cluster_fl.sweep.grid`; pre-flight (:mod:`cluster_fl.sweep.preflight`) runs before every
submission and under ``--dry-run``, which also prints each job's resources and estimates. Exit 2
when pre-flight finds a problem (one line each, nothing submitted); exit 1 when a waited-for run
failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from cluster_fl.config import parse_override
from cluster_fl.sweep.grid import (CLUSTERS, TrainFn, check_devices, seed_major, submit)
from cluster_fl.sweep.gridspec import Grid, RunSpec, load_grid, run_folder
from cluster_fl.sweep.pack import check_packing, packs, runs_per_task
from cluster_fl.report.round0 import score_round0
from cluster_fl.sweep.preflight import PreflightFailed, expand_cells, job_lines, preflight
from cluster_fl.sweep.status import (RESUBMIT, format_states, grid_states_of, progress_text,
                                     read_registry, run_progress)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("grid", help="grid YAML (configs/grids/*.yaml)")
    parser.add_argument("--cluster", choices=CLUSTERS, default="local",
                        help="slurm: one array job; local: local processes; debug: in this process")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, submit nothing")
    parser.add_argument("--wait", action="store_true", help="block until the submitted runs end")
    parser.add_argument("--round0", action="store_true",
                        help="also score the starting model (table row round-0) of each "
                             "arch x condition x seed here, once (cached), before submitting")
    parser.add_argument("--parallel", type=int, default=None, metavar="N",
                        help="at most N runs at a time (local: waves of N; slurm: the array's %%N); "
                             "default: the grid's resources.array_parallelism")
    parser.add_argument("--out", default=None, help="results root (default: the grid's 'out')")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="key=value",
                        help="override for every run (repeatable), e.g. --set fl.rounds=2")


def run(args: argparse.Namespace, train_fn: TrainFn | None = None) -> int:
    grid = load_grid(args.grid, out=args.out)
    parallel = getattr(args, "parallel", None)  # callers building a Namespace may leave it out
    if parallel is not None:  # this machine's width, not the grid's: e.g. a GPU grid on 2 cores
        grid = dataclasses.replace(grid, resources=dataclasses.replace(
            grid.resources, array_parallelism=parallel))  # Resources checks it (>= 1)
    extra = dict(parse_override(o) for o in args.overrides)
    specs, problems = expand_cells(grid, extra)
    states = grid_states_of(specs, read_registry(grid))  # the valid cells' runs
    todo = [s for s, state in states if state in RESUBMIT]
    print(f"grid {grid.experiment}: {len(states)} runs under {grid.root}")
    print(format_states(states))
    try:  # nothing doomed reaches the queue; an injected train_fn reads no engine inputs
        preflight(grid, todo, args.cluster, inputs=train_fn is None, problems=problems)
    except PreflightFailed as failed:
        for problem in failed.problems:
            print(f"cluster-fl grid: error: {problem.line()}", file=sys.stderr)
        print(f"pre-flight: {len(failed.problems)} problem(s); nothing was submitted",
              file=sys.stderr)
        return 2
    if args.dry_run:
        for line in check_devices(grid, todo, args.cluster):
            print(line)
        if grid.resources.runs_per_gpu > 1 and todo:
            for line in check_packing(grid, todo):
                print(line)
            print(f"{len(todo)} runs in {len(packs(grid, todo))} task(s) of up to "
                  f"{runs_per_task(grid)} (resources.runs_per_gpu={grid.resources.runs_per_gpu})")
        for spec in seed_major(todo):  # the order submit uses
            axes = " ".join(f"{k}={v}" for k, v in spec.axes.items())
            print(f"would submit {spec.run_id}  ({axes} seed={spec.seed}) -> {run_folder(spec.config)}")
            if train_fn is None:
                for line in job_lines(grid, spec):
                    print(line)
        print(f"dry run: {len(todo)} of {len(states)} runs would be submitted to {args.cluster}")
        return 0
    if getattr(args, "round0", False):  # callers building a Namespace may leave it out
        score_round0(grid, extra)
    jobs, failed = submit(grid, todo, args.cluster, train_fn=train_fn, wait=args.wait)
    ids = sorted({str(j.job_id).split("_")[0] for j in jobs})
    tasks = f" in {len(jobs)} task(s)" if len(jobs) != len(todo) else ""  # runs_per_gpu > 1
    print(f"submitted {len(todo) if jobs else 0} runs{tasks} to {args.cluster}"
          + (f" (job {', '.join(ids)})" if ids else ""))
    if args.wait and todo:  # the summary of what was waited for: states, then each run's outcome
        print(summary(grid, todo))
    if failed:
        print(f"{len(failed)} of {len(jobs)} runs failed (`cluster-fl status {args.grid}`; "
              "submitting the grid again resubmits them)")
        return 1
    return 0


def summary(grid: Grid, specs: list[RunSpec]) -> str:
    """The states of ``specs`` and, per finished run, its WER and ε (``grid --wait``'s last words)."""
    states = grid_states_of(specs, read_registry(grid))
    lines = ["summary:", format_states(states)]
    for spec, state in states:
        lines.append(f"{state:<8} {spec.run_id}: {progress_text(run_progress(run_folder(spec.config)))}")
    return "\n".join(lines)
