#!/usr/bin/env python
"""Render slurm/torchrun.sbatch for a grid: writes the missing/failed runs' configs + manifest and
prints (or writes) the sbatch script. Usage:

    python slurm/render_sbatch.py configs/grids/paper.yaml [--out job.sbatch] [--set key=value ...]
    sbatch job.sbatch
"""

import argparse
import sys
from pathlib import Path

from cluster_fl.config import parse_override
from cluster_fl.sweep.grid import pending_runs
from cluster_fl.sweep.gridspec import load_grid
from cluster_fl.sweep.sbatch import render, write_manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("grid")
    parser.add_argument("--out", default=None, help="write the sbatch file here (default: stdout)")
    parser.add_argument("--results", default=None, help="results root (default: the grid's 'out')")
    parser.add_argument("--python", default=sys.executable, help="python on the compute nodes")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="key=value")
    args = parser.parse_args(argv)
    grid = load_grid(args.grid, out=args.results)
    todo, states = pending_runs(grid, dict(parse_override(o) for o in args.overrides))
    if not todo:
        print(f"nothing to run: all {len(states)} runs are done or running", file=sys.stderr)
        return 0
    text = render(grid, write_manifest(grid, todo), len(todo), python=args.python)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: {len(todo)} of {len(states)} runs", file=sys.stderr)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
