"""The runs' update norms per table cell (``cluster-fl table --norms``): finding (a) of the paper.

For each (arch, condition, method) cell with per-group norms in its ``rounds.parquet`` (runs
with ``privacy.diagnostics`` exact or noised, and non-private runs), per run:

* component norm m_c = mean over the component's groups of the group's norm ``norm/<group>``
  averaged over rounds (each round's value is already the mean over that round's clients);
* ratio = m_decoder / m_encoder, :mod:`cluster_fl.training.calibrate`'s definition (the
  connector is reported, not in the ratio), so a run can be set beside the probe's prediction;
* clip rate = mean over rounds of the fraction of clients clipped in any group, and its value
  in the last round.

A cell reports the means over its seeds and the ratio's std over seeds. Noised diagnostics make
the norms noisy estimates; the table says which cells used them.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from cluster_fl.report.results import Run, fmt, method_key

COMPONENTS = ("encoder", "connector", "decoder")


@dataclass
class NormRow:
    arch: str
    condition: str
    method: str
    n: int                      # runs (seeds) in the cell
    rounds: int                 # rounds per run (the most any run of the cell has)
    components: dict[str, float] = field(default_factory=dict)
    ratio: float = math.nan
    ratio_std: float = math.nan
    clip_rate: float = math.nan
    clip_rate_last: float = math.nan
    noised: bool = False


def _run_norms(run: Run) -> dict[str, float] | None:
    """Component norms of one run, or None when it logged no per-group norms."""
    by_comp: dict[str, list[float]] = defaultdict(list)
    for g in run.groups:
        norm = run.round_mean(f"norm/{g['name']}")
        if math.isfinite(norm):
            by_comp[g["component"]].append(norm)
    return {c: float(np.mean(v)) for c, v in by_comp.items()} or None


def _clip_rates(run: Run) -> tuple[float, float]:
    """Mean clip rate over rounds, and the last round's."""
    last = max(run.rounds, key=lambda row: int(row["round"]), default={}).get("clip_rate")
    return run.round_mean("clip_rate"), math.nan if last is None else float(last)


def norm_rows(runs: Sequence[Run]) -> list[NormRow]:
    """One :class:`NormRow` per cell whose runs logged per-group norms, in the table's order."""
    cells: dict[tuple[str, str, str], list[tuple[Run, dict[str, float]]]] = defaultdict(list)
    for r in runs:
        norms = _run_norms(r)
        if norms is not None:
            cells[(r.arch, r.condition, r.method)].append((r, norms))
    rows = []
    for (arch, cond, method), members in cells.items():
        comps = {c: float(np.mean([n[c] for _, n in members if c in n]))
                 for c in COMPONENTS if any(c in n for _, n in members)}
        ratios = [n["decoder"] / n["encoder"] for _, n in members
                  if n.get("encoder") and "decoder" in n]
        clips = [_clip_rates(r) for r, _ in members]
        rows.append(NormRow(
            arch=arch, condition=cond, method=method, n=len(members),
            rounds=max(len(r.rounds) for r, _ in members), components=comps,
            ratio=float(np.mean(ratios)) if ratios else math.nan,
            ratio_std=float(np.std(ratios, ddof=1)) if len(ratios) > 1 else math.nan,
            clip_rate=float(np.nanmean([c[0] for c in clips])) if method != "fedavg" else math.nan,
            clip_rate_last=float(np.nanmean([c[1] for c in clips])) if method != "fedavg" else math.nan,
            noised=any(r.setting("privacy", "diagnostics", "exact") == "noised"
                       for r, _ in members)))
    rows.sort(key=lambda x: (x.arch, x.condition, method_key(x.method)))
    return rows


def _ratio_text(row: NormRow) -> str:
    if math.isnan(row.ratio):
        return "—"
    return f"{row.ratio:.1f}×" + ("" if math.isnan(row.ratio_std) else f" ± {row.ratio_std:.1f}")


def norms_markdown(rows: Sequence[NormRow]) -> str:
    out = ["Update norms: mean group norm ‖Δ_h‖₂ per component (over groups, rounds, clients; "
           "mean over seeds), decoder/encoder ratio (± std over seeds), fraction of clients "
           "clipped (mean over rounds, last round)", "",
           "| arch | condition | method | n | rounds | " + " | ".join(COMPONENTS)
           + " | decoder/encoder | clip rate |",
           "|---|---|---|---|---|" + "---|" * (len(COMPONENTS) + 2)]
    for r in rows:
        clip = ("—" if math.isnan(r.clip_rate)
                else f"{r.clip_rate:.3f} (last {r.clip_rate_last:.3f})")
        method = r.method + (" (noised)" if r.noised else "")
        out.append(f"| {r.arch} | {r.condition} | {method} | {r.n} | {r.rounds} | "
                   + " | ".join(fmt(r.components.get(c, math.nan)) for c in COMPONENTS)
                   + f" | {_ratio_text(r)} | {clip} |")
    return "\n".join(out) + "\n"


def norms_csv(rows: Sequence[NormRow]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["arch", "condition", "method", "n_seeds", "rounds"]
               + [f"norm/{c}" for c in COMPONENTS]
               + ["ratio_decoder_encoder", "ratio_std", "clip_rate_mean", "clip_rate_last",
                  "diagnostics_noised"])
    for r in rows:
        w.writerow([r.arch, r.condition, r.method, r.n, r.rounds]
                   + [r.components.get(c, math.nan) for c in COMPONENTS]
                   + [r.ratio, r.ratio_std, r.clip_rate, r.clip_rate_last, r.noised])
    return buf.getvalue()
