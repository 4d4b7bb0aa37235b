"""The pre-registered findings' verdicts (results/repro/PROTOCOL.md §1, §13) from the study's
comparison tables.

``launch/repro_results.sh`` writes, per grid, the paired comparison against flat
(``<regime>-vs-flat.csv``: ``cluster-fl table --against flat --format csv``), the mild regime's
comparison against α-split at calibrate's α (``mild-vs-alpha-split.csv``) and the update-norm
table (``<regime>-norms.csv``). This module reads those files and applies the protocol's rules,
so the README's findings table is computed from committed tables, never typed:

* L (the federated stage learns), b1 (heavy: uniform per-layer collapses), b2 (heavy: size-EMA
  falls behind): **reproduced** when the comparison's verdict is ``worse`` (round-0 / uniform /
  size-EMA against flat), else **not reproduced**;
* c (heavy: α-split within noise of flat; each α-split row, the paper's α and calibrate's):
  ``worse`` -> not reproduced; otherwise reproduced when the 95% CI of Δ lies inside the
  equivalence margin ±MARGIN, **inconclusive** when the CI crosses the margin, and not
  reproduced when it lies wholly beyond -MARGIN (better than flat by more than the margin);
* d (mild: size-EMA as good as or better than α-split at calibrate's α): ``worse`` -> not
  reproduced; otherwise reproduced when the CI's upper end is below +MARGIN, else inconclusive;
* a (the decoder/encoder update-norm ratio): descriptive, from the norms table.

Two checks stand between a table and a verdict. The verdict column is not trusted: each row's
verdict is decided again from its Δ and its Holm-corrected p (worse / better when p < 0.05 on Δ's
side, else within noise), and a row whose column says otherwise is flagged. And with fewer than
``MIN_BOOTSTRAP_SEEDS`` seeds a percentile bootstrap over seeds is too narrow to carry an
equivalence margin (it resamples from three values): c and d then judge the wider of the
bootstrap CI and the t-interval of the seed-level paired test, Δ ± t(0.975, n−1)·SE, where SE is
recovered exactly from Δ and the test's two-sided p (t = Δ / SE).

Every other row of a comparison table is listed as secondary, with its verdict. A grid still
running gives fewer seeds than planned, or a table with fewer comparisons than planned (so
Holm's family, and every p (Holm) in it, is still to grow): its rows say ``interim (n of N
seeds)`` and/or ``interim (Holm over k of K comparisons)``.

    python -m cluster_fl.report.findings results/repro [--out results/repro/findings.md]
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

MARGIN = 0.02  # PROTOCOL §1: the equivalence margin of findings c and d, in WER
LEVEL = 0.05  # PROTOCOL §1: the verdicts' level, on Holm-corrected p
MIN_BOOTSTRAP_SEEDS = 5  # below this, c and d also use the t-interval (the wider of the two)

# grid -> seeds planned (PROTOCOL §4, §13); (finding, grid) -> the paper's result
GRIDS = {"heavy": 5, "mild": 5, "eurollm": 3, "private": 3}
# grid -> comparisons planned in each of its tables: every method but the reference, plus
# round-0 (configs/grids/repro-*.yaml: 9, 9, 5 and 3 methods)
COMPARISONS = {"heavy": 9, "mild": 9, "eurollm": 5, "private": 3}
PAPER = {
    ("a", "heavy"): "~10× (Whisper+TinyLlama)",
    ("a", "mild"): "~1.7× (Voxtral)",
    ("a", "eurollm"): "~10× (Whisper+EuroLLM)",
    ("b1", "heavy"): "uniform 0.9944 vs flat 0.1959",
    ("b1", "eurollm"): "uniform collapses",
    ("b2", "heavy"): "size-EMA 0.2599 vs flat 0.1959",
    ("c", "heavy"): "α-split 0.1986 vs flat 0.1959",
    ("c", "eurollm"): "α-split within noise of flat",
    ("d", "mild"): "size-EMA 0.1413 vs α-split 0.1495",
}
CLAIMS = {
    "a": "decoder/encoder update-norm ratio",
    "L": "the federated stage learns (round-0 worse than flat)",
    "b1": "uniform per-layer collapses (worse than flat)",
    "b2": "size-EMA per-layer falls behind flat",
    "c": "α-split within noise of flat (CI inside ±0.02)",
    "d": "size-EMA as good as or better than α-split at calibrate's α (CI below +0.02)",
}
# which findings each grid tests (PROTOCOL §1 for heavy and mild, §13 for the others)
TESTED = {"heavy": ("a", "L", "b1", "b2", "c"), "mild": ("a", "L", "d"),
          "eurollm": ("a", "L", "b1", "c"), "private": ()}


@dataclass(frozen=True)
class Row:
    """One comparison row of a ``--against`` csv."""

    grid: str
    method: str
    reference: str
    n_seeds: int
    delta: float
    ci_low: float
    ci_high: float
    p_holm: float
    verdict: str
    comparisons: int = 0   # the size of Holm's family in the row's table (0: not recorded)
    p: float = math.nan    # the test's uncorrected two-sided p (nan: not recorded)

    @classmethod
    def from_csv(cls, grid: str, rec: dict[str, str]) -> "Row":
        return cls(grid, rec["method"], rec["reference"], int(rec["n_seeds"]),
                   float(rec["delta_wer"]), float(rec["ci_low"]), float(rec["ci_high"]),
                   float(rec["p_holm"]), rec["verdict"], int(rec.get("comparisons") or 0),
                   float(rec.get("p") or "nan"))

    @property
    def checked_verdict(self) -> str:
        """The verdict its Δ and Holm p give (the column's is not trusted)."""
        if self.p_holm < LEVEL:
            return "worse" if self.delta > 0 else "better"
        return "within noise"

    def t_interval(self) -> tuple[float, float]:
        """The 95% t-interval of the seed-level paired test, from Δ and its two-sided p
        (the whole line when it cannot be recovered: p missing, 1 or Δ exactly 0)."""
        from scipy import stats

        df = self.n_seeds - 1
        if df < 1 or not 0 < self.p < 1 or self.delta == 0:
            return -math.inf, math.inf
        se = abs(self.delta) / float(stats.t.isf(self.p / 2, df))
        half = float(stats.t.ppf(0.975, df)) * se
        return self.delta - half, self.delta + half

    def interval(self) -> tuple[float, float, str]:
        """(low, high, which) the equivalence findings judge: the bootstrap CI, or with fewer
        than ``MIN_BOOTSTRAP_SEEDS`` seeds the wider of it and the t-interval."""
        if self.n_seeds >= MIN_BOOTSTRAP_SEEDS:
            return self.ci_low, self.ci_high, "bootstrap"
        lo, hi = self.t_interval()
        if lo <= self.ci_low and hi >= self.ci_high:
            return lo, hi, "t"
        return min(lo, self.ci_low), max(hi, self.ci_high), "wider of t and bootstrap"


@dataclass(frozen=True)
class Finding:
    """One finding's outcome in one grid (``row`` is None for the descriptive finding a)."""

    id: str
    grid: str
    outcome: str   # reproduced / not reproduced / inconclusive / reported / not run yet
    detail: str
    row: Row | None = None
    interim: str = ""


def outcome(finding: str, row: Row, margin: float = MARGIN) -> str:
    """The protocol's rule (module docstring) for one comparison row, on its checked verdict
    and, for c and d, the interval :meth:`Row.interval` picks."""
    verdict = row.checked_verdict
    if finding in ("L", "b1", "b2"):
        return "reproduced" if verdict == "worse" else "not reproduced"
    if finding not in ("c", "d"):
        raise ValueError(f"no rule for finding {finding!r}")
    if verdict == "worse":
        return "not reproduced"
    low, high, _ = row.interval()
    if finding == "d":
        return "reproduced" if high < margin else "inconclusive"
    if -margin < low and high < margin:
        return "reproduced"
    return "not reproduced" if high <= -margin else "inconclusive"


def _read(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _interim(grid: str, row: Row) -> str:
    """Why the row's numbers may still change: too few seeds, or a Holm family still growing."""
    why = []
    if row.n_seeds < GRIDS[grid]:
        why.append(f"{row.n_seeds} of {GRIDS[grid]} seeds")
    if 0 < row.comparisons < COMPARISONS[grid]:
        why.append(f"Holm over {row.comparisons} of {COMPARISONS[grid]} comparisons")
    return f"interim ({'; '.join(why)})" if why else ""


def _is(method: str, name: str) -> bool:
    """``method`` (a table label such as ``size-ema per-layer``) is the method ``name``."""
    return method == name or method.startswith(name + " ")


def grid_findings(grid: str, tables: Path, margin: float = MARGIN) -> tuple[list[Finding], list[Row]]:
    """(the tested findings, the secondary rows) of one grid from its tables in ``tables``."""
    rows = [Row.from_csv(grid, r) for r in _read(tables / f"{grid}-vs-flat.csv")]
    found: list[Finding] = []
    used: set[str] = set()

    def test(fid: str, candidates: Sequence[Row], what: str) -> None:
        if not candidates:
            found.append(Finding(fid, grid, "not run yet", what))
        for r in candidates:
            used.add(r.method)
            found.append(Finding(fid, grid, outcome(fid, r, margin), f"{r.method} vs {r.reference}",
                                 r, _interim(grid, r)))

    for fid in TESTED[grid]:
        if fid == "a":
            norms = _read(tables / f"{grid}-norms.csv")
            ratios = [float(r["ratio_decoder_encoder"]) for r in norms
                      if math.isfinite(float(r["ratio_decoder_encoder"]))]
            span = (f"{min(ratios):.1f}×" if f"{min(ratios):.1f}" == f"{max(ratios):.1f}"
                    else f"{min(ratios):.1f}-{max(ratios):.1f}×") if ratios else ""
            detail = (f"{span} (mean over seeds; {len(ratios)} methods' runs, `{grid}-norms`)"
                      if ratios else "no norms table yet")
            found.append(Finding("a", grid, "reported" if ratios else "not run yet", detail))
        elif fid == "L":
            test("L", [r for r in rows if r.method == "round-0"], "round-0 vs flat")
        elif fid == "b1":
            test("b1", [r for r in rows if _is(r.method, "uniform")], "uniform vs flat")
        elif fid == "b2":
            test("b2", [r for r in rows if _is(r.method, "size-ema")], "size-EMA vs flat")
        elif fid == "c":
            test("c", [r for r in rows if _is(r.method, "alpha-split")], "α-split vs flat")
        elif fid == "d":
            against = [Row.from_csv(grid, r) for r in _read(tables / "mild-vs-alpha-split.csv")]
            test("d", [r for r in against if _is(r.method, "size-ema")], "size-EMA vs α-split")
    return found, [r for r in rows if r.method not in used]


def fedavg_gain(rows: Sequence[Row]) -> float | None:
    """FedAvg's gain over round-0 in WER (both against flat on the same seeds), or None."""
    by = {r.method: r for r in rows}
    r0, fa = by.get("round-0"), by.get("fedavg")
    if r0 is None or fa is None or r0.n_seeds != fa.n_seeds:
        return None
    return r0.delta - fa.delta


def _delta(r: Row) -> str:
    return f"{r.delta:+.4f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]"


def _seeds(n: int) -> str:
    return f"({n} seed{'' if n == 1 else 's'})"


def _fmt_row(r: Row | None, finding: str = "") -> str:
    if r is None:
        return "— | — | —"
    delta = _delta(r)
    low, high, which = r.interval()
    if finding in ("c", "d") and which != "bootstrap":
        delta += f"; {which} [{low:+.3f}, {high:+.3f}]"
    return f"{delta} | {r.p_holm:.4f} | {_verdict(r)} {_seeds(r.n_seeds)}"


def _verdict(r: Row) -> str:
    """The checked verdict, and the column's where it differs."""
    if r.verdict == r.checked_verdict:
        return r.verdict
    return f"{r.checked_verdict} (the table says {r.verdict}: does not match Δ and p)"


def findings_markdown(tables: Path, margin: float = MARGIN) -> str:
    """The findings table and the secondary rows of every grid with tables in ``tables``."""
    head = ["Pre-registered findings (results/repro/PROTOCOL.md §1, §13), from the comparison "
            f"tables in this folder: two-sided seed-level paired t-test, Holm across each table, "
            f"level 0.05 (each verdict checked against its Δ and p); findings c and d also need the "
            f"95% CI inside the {margin:g} WER margin (else inconclusive) -- with fewer than "
            f"{MIN_BOOTSTRAP_SEEDS} seeds the wider of the bootstrap CI and the paired test's "
            "t-interval, shown after it.", "",
            "| finding | grid | paper | comparison | Δ WER [95% CI] | p (Holm) | verdict | outcome |",
            "|---|---|---|---|---|---|---|---|"]
    lines, secondary = list(head), []
    for grid in GRIDS:
        if not (tables / f"{grid}-vs-flat.csv").is_file():
            continue
        found, rest = grid_findings(grid, tables, margin)
        for f in found:
            out = f.outcome + (f", {f.interim}" if f.interim else "")
            lines.append(f"| {f.id}: {CLAIMS[f.id]} | {grid} | {PAPER.get((f.id, grid), '—')} | "
                         f"{f.detail} | {_fmt_row(f.row, f.id)} | **{out}** |")
        gain = fedavg_gain([f.row for f in found if f.row is not None] + rest)
        if gain is not None:
            secondary.append(f"- {grid}: FedAvg's gain over round-0: {gain:.4f} WER")
        for r in rest:
            interim = _interim(grid, r)
            secondary.append(f"- {grid}: {r.method} vs {r.reference}: Δ {_delta(r)}, p (Holm) "
                             f"{r.p_holm:.4f}, {_verdict(r)} {_seeds(r.n_seeds)}"
                             + (f", {interim}" if interim else ""))
    if len(lines) == len(head):
        return "No comparison tables yet (launch/repro_results.sh writes them).\n"
    if secondary:
        lines += ["", "Secondary rows (reported with their verdicts, not pre-registered findings):",
                  "", *secondary]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tables", type=Path, help="folder of the study's tables (results/repro)")
    ap.add_argument("--out", type=Path, help="write here instead of stdout")
    args = ap.parse_args(argv)
    text = findings_markdown(args.tables)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
