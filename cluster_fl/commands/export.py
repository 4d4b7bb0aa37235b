"""``cluster-fl export RUN OUT``: a run's adapters as PEFT / safetensors, with a model card.

The formats and what the card reads are :mod:`cluster_fl.engine.export`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster_fl.engine.export import export_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run folder (<out>/<experiment>/<run_id>)")
    parser.add_argument("out", help="folder to write the export to")


def run(args: argparse.Namespace) -> int:
    for path in export_run(Path(args.run), Path(args.out)):
        print(path)
    return 0
