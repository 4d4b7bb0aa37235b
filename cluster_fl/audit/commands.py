"""``cluster-fl audit RUN_DIR [--out DIR]``: the privacy audit of one run folder (DESIGN §9).

Reads the run's config (gates fixed before the run: ``audit.margin_pp``, ``audit.family_alpha``,
``audit.canaries``) and its ``channels/`` recordings, runs the battery of
:mod:`cluster_fl.audit.battery` and writes report.md, report.json and dose_response.png to
``--out`` (default ``RUN_DIR/audit``). Exit code 0 whatever the verdicts: a failed gate is a
finding, not an error; it is printed as one summary line per verdict.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from cluster_fl.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """RUN_DIR, --out, --seed."""
    parser.add_argument("run_dir", help="a run folder (<out>/<experiment>/<run_id>)")
    parser.add_argument("--out", default=None, help="report folder (default RUN_DIR/audit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the audit's own randomness")


def run(args: argparse.Namespace) -> int:
    """Run the battery and write the report."""
    import torch

    from cluster_fl.audit.battery import run_battery
    from cluster_fl.audit.report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run folder not found: {run_dir}")
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    rep = run_battery(run_dir, seed=args.seed)
    paths = write_report(rep, Path(args.out) if args.out else run_dir / "audit")
    verdicts = Counter(a["verdict"] for ch in rep["channels"] for a in ch["attacks"])
    print(f"audit: {dict(verdicts)}; report {paths['md']}")
    return 0
