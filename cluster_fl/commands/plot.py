"""``cluster-fl plot RESULTS... --out DIR``: the paper's figures from run folders
(:mod:`cluster_fl.report.plot`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster_fl.errors import UserError
from cluster_fl.report.plot import make_figures
from cluster_fl.report.results import find_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="results folders (searched for final.parquet)")
    parser.add_argument("--out", required=True, help="folder for the PNG files")


def run(args: argparse.Namespace) -> int:
    runs = find_runs(args.results)
    if not runs:
        raise UserError(f"no run folders (final.parquet) under {' '.join(args.results)}")
    for path in make_figures(runs, Path(args.out)):
        print(path)
    return 0
