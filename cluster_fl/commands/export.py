"""``cluster-fl export RUN OUT``: a run's adapters as PEFT / safetensors, with a model card.

The formats and what the card reads are :mod:`cluster_fl.engine.export`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster_fl.commands import load_checked
from cluster_fl.engine.export import export_run
from cluster_fl.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run folder (<out>/<experiment>/<run_id>)")
    parser.add_argument("out", help="folder to write the export to")


def run(args: argparse.Namespace) -> int:
    recorded = Path(args.run) / "config.yaml"
    if not recorded.is_file():
        raise UserError(f"{args.run} is not a run folder (no config.yaml)")
    for path in export_run(Path(args.run), Path(args.out), load_checked(str(recorded), [])):
        print(path)
    return 0
