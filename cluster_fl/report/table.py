"""``cluster-fl table RESULTS...``: the paper's tables from run folders.

Layout: rows architecture x condition (frozen / unfrozen encoder), columns methods. A cell is the
WER mean ± sample std (ddof = 1) over seeds, with a 95% CI from the hierarchical bootstrap of
:mod:`cluster_fl.report.stats`: one resample draws the cell's seeds with replacement and the
evaluated speakers with replacement -- one speaker draw for every seed -- computes each drawn
run's WER (Σ word errors / Σ reference words over the drawn speakers' utterances) and averages
over the drawn seeds: the same statistic as the cell's mean, so the CI covers both training
randomness (seeds) and the sampling of test speakers. The draws depend only on the numbers of
seeds and speakers, so cells with the same seeds and speakers share them (one draw across
methods). A second table lists
ε, δ, the guarantee behind ε (``valid``: secure mode; ``simulation``: research mode, whose
recorded seed regenerates the noise; ``void``; ``none``: the weakest among the cell's runs;
``no client data`` for round-0, whose ε is 0) and the
per-pool effective noise multipliers σ_k = σ/√α_k.

Formats: ``md`` (both tables), ``latex`` (both, booktabs), ``csv`` (tidy: one row per cell with
every statistic as its own column, for further analysis). A run in secure mode has no seed: it
counts as one replicate and is listed as ``secure``. A damaged results file (a truncated
final.parquet or eval.parquet) is a one-line error naming it, never a traceback, and never a table
that silently leaves the run out.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cluster_fl.report.results import NO_CLIENT_DATA, Run, fmt, method_key
from cluster_fl.privacy.accounting import GUARANTEE_ORDER
from cluster_fl.report.stats import bootstrap_draws, percentile_interval, replicate_means

BOOTSTRAP = 2000


@dataclass
class Cell:
    """Statistics of one (arch, condition, method) over its seeds."""

    arch: str
    condition: str
    method: str
    runs: list[Run]
    mean: float
    std: float
    ci_low: float
    ci_high: float
    epsilon: float
    delta: float
    sigmas: dict[str, float]
    guarantee: str = "?"

    @property
    def n(self) -> int:
        return len(self.runs)


def clustered_bootstrap_ci(per_run_rows: Sequence[Sequence[dict]], resamples: int = BOOTSTRAP,
                           seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile CI of the seed-averaged WER of one cell (one entry of ``per_run_rows`` per
    seed): the hierarchical bootstrap over seeds and speakers, one speaker draw shared by every
    seed (speakers keyed by name; a speaker a run did not score counts 0 errors, 0 words)."""
    per_run = [speaker_sums(rows) for rows in per_run_rows if rows]
    if not per_run:
        return float("nan"), float("nan")
    keys = sorted({k for run in per_run for k in run})
    errors = np.array([[run.get(k, (0.0, 0.0))[0] for k in keys] for run in per_run])
    words = np.array([[run.get(k, (0.0, 0.0))[1] for k in keys] for run in per_run])
    draws = bootstrap_draws(len(per_run), len(keys), resamples, seed)
    return percentile_interval(replicate_means(errors, words, draws), level)


def speaker_sums(rows: Sequence[dict]) -> dict[str, tuple[float, float]]:
    """{speaker: (word errors, reference words)} of one run's evaluation rows."""
    sums: dict[str, tuple[float, float]] = {}
    for r in rows:
        e, w = sums.get(str(r["speaker"]), (0.0, 0.0))
        sums[str(r["speaker"])] = (e + float(r["word_errors"]), w + float(r["ref_words"]))
    return sums


def _seed(run: Run) -> int | None:
    """The run's seed, or None for a secure-mode run (which refuses one)."""
    seed = run.final.get("seed")
    return None if seed is None else int(seed)


def _seed_label(run: Run) -> str:
    seed = _seed(run)
    return "secure" if seed is None else str(seed)


def summarise(runs: Sequence[Run], resamples: int = BOOTSTRAP) -> list[Cell]:
    """One :class:`Cell` per (arch, condition, method), sorted in the paper's order."""
    groups: dict[tuple[str, str, str], list[Run]] = defaultdict(list)
    for r in runs:
        groups[(r.arch, r.condition, r.method)].append(r)
    cells = []
    for (arch, condition, method), rs in groups.items():
        rs.sort(key=lambda r: (_seed(r) is None, _seed(r) or 0, str(r.folder)))
        wers = np.array([r.wer for r in rs], dtype=float)
        evals = [r.eval_rows for r in rs if r.eval_rows]
        low, high = clustered_bootstrap_ci(evals, resamples) if evals else (math.nan, math.nan)
        pools = sorted({p for r in rs for p in r.sigmas})
        cells.append(Cell(
            arch=arch, condition=condition, method=method, runs=rs,
            mean=float(wers.mean()), std=float(wers.std(ddof=1)) if len(rs) > 1 else math.nan,
            ci_low=low, ci_high=high,
            epsilon=float(np.mean([float(r.final.get("epsilon", math.nan)) for r in rs])),
            delta=float(rs[0].final.get("delta", math.nan)),
            sigmas={p: float(np.mean([r.sigmas[p] for r in rs if p in r.sigmas])) for p in pools},
            guarantee=weakest_guarantee(r.guarantee for r in rs)))
    cells.sort(key=lambda c: (c.arch, c.condition != "frozen", method_key(c.method)))
    return cells


def weakest_guarantee(guarantees) -> str:
    """The weakest of the runs' guarantees (none < void < simulation < valid; unknown first)."""
    rank = {g: i for i, g in enumerate(GUARANTEE_ORDER)}
    return min(guarantees, key=lambda g: rank.get(g, -1), default="?")


def _layout(cells: Sequence[Cell]) -> tuple[list[tuple[str, str]], list[str], dict]:
    rows = list(dict.fromkeys((c.arch, c.condition) for c in cells))
    methods = sorted({c.method for c in cells}, key=method_key)
    return rows, methods, {(c.arch, c.condition, c.method): c for c in cells}


def _cell_text(c: Cell | None, pm: str = "±") -> str:
    if c is None:
        return ""
    text = fmt(c.mean) + (f" {pm} {fmt(c.std)}" if c.n > 1 else "")
    if not math.isnan(c.ci_low):
        text += f" [{fmt(c.ci_low, 3)}, {fmt(c.ci_high, 3)}]"
    return text + f" (n={c.n})"


def _pools(cells: Sequence[Cell]) -> list[str]:
    return sorted({p for c in cells for p in c.sigmas})


def to_markdown(cells: Sequence[Cell]) -> str:
    """Both tables as GitHub markdown."""
    rows, methods, index = _layout(cells)
    out = ["WER: mean ± std over seeds [95% CI, hierarchical bootstrap over seeds and speakers, one "
           "speaker draw shared by every seed and method] (n seeds)",
           "", "| arch | condition | " + " | ".join(methods) + " |",
           "|---|---|" + "---|" * len(methods)]
    for arch, cond in rows:
        out.append(f"| {arch} | {cond} | "
                   + " | ".join(_cell_text(index.get((arch, cond, m))) for m in methods) + " |")
    pools = _pools(cells)
    round0 = "; no client data: round-0, ε = 0" if any(
        c.guarantee == NO_CLIENT_DATA for c in cells) else ""
    out += ["", "Privacy: ε at δ, its guarantee (simulation: research mode, the recorded seed "
            f"regenerates the noise{round0}), effective noise multiplier σ per pool", "",
            "| " + " | ".join(["arch", "condition", "method", "ε", "δ", "guarantee"]
                              + [f"σ/{p}" for p in pools]) + " |",
            "|---|---|---|---|---|---|" + "---|" * len(pools)]
    # fixed-size cohorts' ε is under replace-one, Poisson's under add/remove: marked, not alike
    fixed = {id(c) for c in cells
             if any(str(r.setting("fl", "sampling", "poisson")) == "fixed" for r in c.runs)}
    for c in cells:  # one cell per column: no empty trailing cell when no run has pools
        eps = fmt(c.epsilon, 3) + ("†" if id(c) in fixed else "")
        out.append("| " + " | ".join([c.arch, c.condition, c.method, eps,
                                      f"{c.delta:g}", c.guarantee]
                                     + [fmt(c.sigmas.get(p, math.nan)) for p in pools]) + " |")
    if fixed:
        out += ["", "† ε under replace-one (fixed-size cohorts of a public N); unmarked ε under "
                    "add/remove one client (Poisson cohorts): the two are not comparable"]
    return "\n".join(out) + "\n"


def _tex(s: str) -> str:
    return (s.replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("&", r"\&")
            .replace("%", r"\%").replace("α", r"$\alpha$").replace("∞", r"$\infty$")
            .replace("—", "--").replace("±", r"$\pm$"))


def to_latex(cells: Sequence[Cell]) -> str:
    """Both tables as LaTeX (booktabs)."""
    rows, methods, index = _layout(cells)
    out = [r"% WER: mean $\pm$ std over seeds [95% CI, hierarchical bootstrap over seeds and "
           r"speakers] (n seeds)",
           r"\begin{tabular}{ll" + "c" * len(methods) + "}", r"\toprule",
           "arch & condition & " + " & ".join(_tex(m) for m in methods) + r" \\", r"\midrule"]
    for arch, cond in rows:
        out.append(f"{_tex(arch)} & {cond} & "
                   + " & ".join(_tex(_cell_text(index.get((arch, cond, m)))) for m in methods) + r" \\")
    pools = _pools(cells)
    out += [r"\bottomrule", r"\end{tabular}", "", r"\begin{tabular}{lll" + "c" * (3 + len(pools)) + "}",
            r"\toprule", r"arch & condition & method & $\varepsilon$ & $\delta$ & guarantee & "
            + " & ".join(rf"$\sigma_{{\mathrm{{{_tex(p)}}}}}$" for p in pools) + r" \\", r"\midrule"]
    for c in cells:
        out.append(f"{_tex(c.arch)} & {c.condition} & {_tex(c.method)} & {_tex(fmt(c.epsilon, 3))} & "
                   f"{c.delta:g} & {c.guarantee} & "
                   + " & ".join(_tex(fmt(c.sigmas.get(p, math.nan))) for p in pools) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(out) + "\n"


def to_csv(cells: Sequence[Cell]) -> str:
    """Tidy CSV: one row per (arch, condition, method) with every statistic as a column."""
    pools = _pools(cells)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["arch", "condition", "method", "n_seeds", "seeds", "wer_mean", "wer_std",
                "wer_ci_low", "wer_ci_high", "epsilon", "delta", "guarantee"]
               + [f"sigma/{p}" for p in pools])
    for c in cells:
        w.writerow([c.arch, c.condition, c.method, c.n, " ".join(_seed_label(r) for r in c.runs),
                    c.mean, c.std, c.ci_low, c.ci_high, c.epsilon, c.delta, c.guarantee]
                   + [c.sigmas.get(p, math.nan) for p in pools])
    return buf.getvalue()


FORMATS = {"md": to_markdown, "latex": to_latex, "csv": to_csv}
