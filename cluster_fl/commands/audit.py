"""``cluster-fl audit RUN_DIR [--out DIR]``: the privacy audit of one run folder (DESIGN §9).

Reads the run's config (gates fixed before the run: ``audit.margin_pp``, ``audit.family_alpha``,
``audit.canaries``) and its ``channels/`` recordings, runs the battery of
:mod:`cluster_fl.audit.battery` and writes report.md, report.json and dose_response.png to
``--out`` (default ``RUN_DIR/audit``). Exit code 0 whatever the verdicts: a failed gate is a
finding, not an error; it is printed as one summary line per verdict.

A folder that is not a run (no config.yaml, status.json, groups.json or channels/) is refused
before anything is written into it, and a report folder that cannot be written (read-only, full)
is found before the battery runs: one line naming it, exit 2.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path

from cluster_fl.errors import UserError


RUN_MARKERS = ("config.yaml", "status.json", "groups.json", "channels")


def _check_writable(out: Path) -> None:
    """Fail before the (long) battery if the report cannot be written to ``out``."""
    probe = out / f".write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"x")
            fh.flush()
    except OSError as exc:
        raise UserError(f"cannot write the audit report to {out}: {exc.strerror or exc}"
                        " (pass --out DIR)") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """RUN_DIR, --out, --seed."""
    parser.add_argument("run_dir", help="a run folder (<out>/<experiment>/<run_id>)")
    parser.add_argument("--out", default=None, help="report folder (default RUN_DIR/audit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the audit's own randomness")


def run(args: argparse.Namespace) -> int:
    """Run the battery and write the report."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run folder not found: {run_dir}")
    if not any((run_dir / name).exists() for name in RUN_MARKERS):
        raise UserError(f"{run_dir} is not a run folder (none of {', '.join(RUN_MARKERS)}); "
                        "pass <out>/<experiment>/<run_id>")
    out = Path(args.out) if args.out else run_dir / "audit"
    _check_writable(out)
    import torch

    from cluster_fl.audit.battery import run_battery
    from cluster_fl.audit.report import write_report

    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    rep = run_battery(run_dir, seed=args.seed)
    try:
        paths = write_report(rep, out)
    except OSError as exc:
        raise UserError(f"cannot write the audit report to {out}: {exc.strerror or exc}"
                        " (pass --out DIR)") from None
    verdicts = Counter(a["verdict"] for ch in rep["channels"] for a in ch["attacks"])
    print(f"audit: {dict(verdicts)}; report {paths['md']}")
    return 0
