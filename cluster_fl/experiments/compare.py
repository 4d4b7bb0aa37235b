"""Paired comparison of two methods over seeds and test speakers (``cluster-fl table --against``).

"Method B is significantly worse than method A" is tested on the pairs the study has: runs of A
and B with the same seed share the cohorts' randomness and are scored on the same evaluation
utterances, so every (seed, speaker) is a pair of error counts over the same reference words.

- Δ = mean over seeds of (WER_B − WER_A), each seed's WER pooled over its speakers: the difference
  of the two cells' means in the WER table.
- p (one-sided, B worse): a sign-flip permutation test over the (seed, speaker) pairs. Under the
  null hypothesis that the method does not matter, each pair's two error counts are exchangeable,
  so Δ's distribution is that of Σ ±d_u / W over random signs; p = (1 + #{Δ* ≥ Δ}) / (1 + R).
  Its false-alarm rate is at most the chosen level whatever the speakers' WER spread (checked by
  a test on null data).
- 95% CI of Δ: percentile bootstrap that redraws each seed's speakers (as the WER table's CI).

Runs that do not pair (a seed only one method has, or evaluation sets that differ) are refused
with a message naming them, never silently dropped.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cluster_fl.errors import UserError
from cluster_fl.experiments.results import Run, fmt, method_key

RESAMPLES = 10000


@dataclass
class Comparison:
    """Method ``method`` against ``reference`` in one (arch, condition)."""

    arch: str
    condition: str
    reference: str
    method: str
    seeds: list[int]
    speakers: int
    delta: float
    ci_low: float
    ci_high: float
    p_worse: float
    p_better: float


def _speaker_table(run: Run) -> dict[str, tuple[float, float]]:
    rows = run.eval_rows
    if not rows:
        raise UserError(f"{run.folder}: no eval.parquet; a paired comparison needs per-utterance rows")
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        table[str(r["speaker"])][0] += float(r["word_errors"])
        table[str(r["speaker"])][1] += float(r["ref_words"])
    return {k: (v[0], v[1]) for k, v in table.items()}


def paired_units(ref: Sequence[Run], other: Sequence[Run]
                 ) -> tuple[list[int], list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per seed both have: (seeds, errors of ref, errors of other, reference words) over shared
    speakers. A seed only one of them has (a grid still running) is left out, and the
    comparison says which seeds it paired."""
    by_seed_a = {r.seed: r for r in ref}
    by_seed_b = {r.seed: r for r in other}
    common = sorted(set(by_seed_a) & set(by_seed_b))
    if not common:
        raise UserError(f"{ref[0].method} has seeds {sorted(by_seed_a)}, {other[0].method} "
                        f"{sorted(by_seed_b)}: no seed in common, nothing pairs")
    seeds, ea, eb, ww = [], [], [], []
    for seed in common:
        a, b = _speaker_table(by_seed_a[seed]), _speaker_table(by_seed_b[seed])
        if set(a) != set(b) or any(a[k][1] != b[k][1] for k in a):
            raise UserError(f"{by_seed_a[seed].folder} and {by_seed_b[seed].folder} were scored "
                            "on different evaluation sets; they do not pair")
        keys = sorted(a)
        seeds.append(seed)
        ea.append(np.array([a[k][0] for k in keys]))
        eb.append(np.array([b[k][0] for k in keys]))
        ww.append(np.array([a[k][1] for k in keys]))
    return seeds, ea, eb, ww


def paired_test(ea: Sequence[np.ndarray], eb: Sequence[np.ndarray], words: Sequence[np.ndarray],
                resamples: int = RESAMPLES, seed: int = 0
                ) -> tuple[float, float, float, float, float]:
    """(Δ, CI low, CI high, one-sided p that B is worse, one-sided p that B is better) for
    per-seed speaker error counts."""
    rng = np.random.default_rng(seed)
    d = [b - a for a, b in zip(ea, eb)]
    totals = [float(w.sum()) for w in words]
    delta = float(np.mean([di.sum() / t for di, t in zip(d, totals)]))
    flipped = np.zeros(resamples)
    boot = np.zeros(resamples)
    for di, w, t in zip(d, words, totals):
        signs = rng.choice(np.array([-1.0, 1.0]), size=(resamples, len(di)))
        flipped += (signs * di).sum(axis=1) / t
        idx = rng.integers(0, len(di), size=(resamples, len(di)))
        boot += di[idx].sum(axis=1) / np.maximum(w[idx].sum(axis=1), 1e-12)
    flipped /= len(d)
    boot /= len(d)
    worse = float((1 + np.count_nonzero(flipped >= delta - 1e-12)) / (1 + resamples))
    better = float((1 + np.count_nonzero(flipped <= delta + 1e-12)) / (1 + resamples))
    low, high = np.percentile(boot, [2.5, 97.5])
    return delta, float(low), float(high), worse, better


def compare(runs: Sequence[Run], reference: str, resamples: int = RESAMPLES) -> list[Comparison]:
    """Every method against ``reference`` (a method label, e.g. ``flat``) per (arch, condition)."""
    cells: dict[tuple[str, str, str], list[Run]] = defaultdict(list)
    for r in runs:
        cells[(r.arch, r.condition, r.method)].append(r)
    out = []
    for (arch, cond) in dict.fromkeys((a, c) for a, c, _ in cells):
        ref = cells.get((arch, cond, reference))
        if ref is None:
            continue
        for (a2, c2, method), rs in sorted(cells.items(), key=lambda kv: method_key(kv[0][2])):
            if (a2, c2) != (arch, cond) or method == reference:
                continue
            seeds, ea, eb, ww = paired_units(ref, rs)
            delta, low, high, worse, better = paired_test(ea, eb, ww, resamples)
            out.append(Comparison(arch, cond, reference, method, seeds,
                                  int(sum(len(w) for w in ww)), delta, low, high, worse, better))
    if not out:
        known = sorted({m for _, _, m in cells}, key=method_key)
        raise UserError(f"--against {reference}: no cell has that method and another to compare; "
                        f"methods: {', '.join(known)}")
    return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def verdict(c: Comparison, level: float = 0.05) -> str:
    """``worse`` / ``better`` when that one-sided test rejects at ``level``, else ``within noise``."""
    if c.p_worse < level:
        return "worse"
    if c.p_better < level:
        return "better"
    return "within noise"


def comparisons_markdown(rows: Sequence[Comparison]) -> str:
    out = ["Paired against the reference method: Δ WER = method − reference (mean over seeds), "
           "95% CI (speakers redrawn per seed), one-sided p that the method is worse "
           "(sign-flip permutation over seed × speaker pairs)", "",
           "| arch | condition | method | reference | Δ WER | 95% CI | p (worse) | pairs | verdict |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        out.append(f"| {c.arch} | {c.condition} | {c.method} | {c.reference} | {fmt(c.delta)} | "
                   f"[{fmt(c.ci_low, 3)}, {fmt(c.ci_high, 3)}] | {fmt(c.p_worse, 4)} | "
                   f"{_count(len(c.seeds), 'seed')} × {c.speakers // max(len(c.seeds), 1)} speakers | "
                   f"{verdict(c)} |")
    return "\n".join(out) + "\n"


def comparisons_csv(rows: Sequence[Comparison]) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["arch", "condition", "method", "reference", "seeds", "pairs", "delta_wer",
                "ci_low", "ci_high", "p_worse", "p_better", "verdict"])
    for c in rows:
        w.writerow([c.arch, c.condition, c.method, c.reference, " ".join(map(str, c.seeds)),
                    c.speakers, c.delta, c.ci_low, c.ci_high, c.p_worse, c.p_better, verdict(c)])
    return buf.getvalue()
