"""``cluster-fl table RESULTS... [--format md|csv|latex] [--out FILE] [--against METHOD | --norms]``.

The statistics (mean ± std over seeds, hierarchical-bootstrap CIs over seeds and speakers, ε and
per-pool σ) are :mod:`cluster_fl.report.table`; ``--against METHOD`` prints instead every
method paired against METHOD (Δ WER, hierarchical CI, two-sided seed-level paired t-test,
Holm-corrected across the table, verdict at the stated level, n seeds × n speakers;
:mod:`cluster_fl.report.compare`);
``--norms`` the runs' update norms per component, decoder/encoder ratio and clip rates
(:mod:`cluster_fl.report.norm_table`).
A damaged results file is a one-line error naming it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from cluster_fl.errors import UserError, short_reason
from cluster_fl.report.results import find_runs, mixed_starting_models
from cluster_fl.report.table import BOOTSTRAP, FORMATS, summarise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="results folders (searched for final.parquet)")
    parser.add_argument("--format", choices=sorted(FORMATS), default="md")
    parser.add_argument("--out", default=None, help="write to this file instead of stdout")
    parser.add_argument("--bootstrap", type=int, default=BOOTSTRAP, help="bootstrap resamples")
    parser.add_argument("--against", default=None, metavar="METHOD",
                        help="paired comparison of every method against METHOD (e.g. flat): "
                             "Δ WER, 95%% CI, two-sided seed-level p, Holm-corrected across "
                             "the table (md or csv)")
    parser.add_argument("--norms", action="store_true",
                        help="the runs' update norms per component, decoder/encoder ratio and "
                             "clip rates, from their per-round diagnostics (md or csv)")

def _damaged(paths: Sequence[str], exc: Exception) -> UserError:
    """The error for a results file that does not read: name the first damaged file found."""
    import pyarrow.parquet as pq

    for p in paths:
        root = Path(p).expanduser()
        files = [root] if root.is_file() else sorted(
            f for name in ("final.parquet", "eval.parquet") for f in root.rglob(name))
        for f in files:
            try:
                pq.read_metadata(f)
            except Exception as bad:  # noqa: BLE001 - any reason makes the file unusable
                reason = short_reason(bad)
                return UserError(f"{f}: unreadable results file ({reason}); restore it, or "
                                 "delete the run folder and run it again")
    reason = short_reason(exc)
    return UserError(f"unreadable results under {' '.join(paths)} ({reason})")


def run(args: argparse.Namespace) -> int:
    import pyarrow as pa

    try:
        runs = find_runs(args.results)
        if not runs:
            raise UserError(f"no run folders (final.parquet) under {' '.join(args.results)}")
        for warning in mixed_starting_models(runs):
            print(f"warning: {warning}", file=sys.stderr)
        norms = getattr(args, "norms", False)
        if norms and (args.against or args.format == "latex"):
            raise UserError("--norms writes md or csv, and not with --against")
        if norms:
            from cluster_fl.report.norm_table import norm_rows, norms_csv, norms_markdown
            rows = norm_rows(runs)
            if not rows:
                raise UserError("no run logged per-group norms (privacy.diagnostics: exact or "
                                f"noised) under {' '.join(args.results)}")
            text = (norms_csv if args.format == "csv" else norms_markdown)(rows)
        elif args.against:
            from cluster_fl.report.compare import (compare, comparisons_csv,
                                                        comparisons_markdown)
            if args.format == "latex":
                raise UserError("--against writes md or csv")
            rows = compare(runs, args.against)
            text = (comparisons_csv if args.format == "csv" else comparisons_markdown)(rows)
        else:
            text = FORMATS[args.format](summarise(runs, args.bootstrap))
    except (pa.ArrowException, OSError) as exc:
        raise _damaged(args.results, exc) from None
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as exc:
            raise UserError(f"--out: cannot write {args.out}: {exc.strerror or exc}") from None
        print(f"wrote {args.out} ({len(runs)} runs)")
    else:
        print(text, end="")
    return 0
