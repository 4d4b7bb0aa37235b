"""Paired comparison of methods over seeds and test speakers (``cluster-fl table --against``).

Runs of two methods with the same seed share their cohorts, client batches and starting model
(not their noise, which is scoped by run id), and are scored on the same evaluation
utterances; the seed is the unit of replication (:mod:`cluster_fl.report.stats` has the
reasons and the definitions):

- Δ = mean over seeds of (WER_B,s − WER_A,s), each seed's WER pooled over its speakers: the
  difference of the two cells' means in the WER table.
- 95% CI of Δ: hierarchical bootstrap -- seeds resampled, and speakers with ONE draw shared by
  both methods and every seed of a replicate.
- p: two-sided paired t-test over the per-seed differences (S − 1 degrees of freedom); with one
  seed, a two-sided sign-flip test over the speakers of that one run (test-set sampling only),
  and the ``test`` column says so. The exact sign-flip p over seeds is reported beside it.
- Holm's correction across every comparison of the table; the verdict (``worse``, ``better``,
  ``within noise``) is read from the Holm-adjusted p at LEVEL (0.05, two-sided).

Runs that do not pair (a seed only one method has, or evaluation sets that differ) are refused
with a message naming them, never silently dropped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cluster_fl.errors import UserError
from cluster_fl.report.results import Run, fmt, method_key
from cluster_fl.report.stats import (LEVEL, bootstrap_draws, holm, paired_t,
                                          percentile_interval, replicate_means, sign_flip_exact,
                                          sign_flip_units)
from cluster_fl.report.table import speaker_sums

RESAMPLES = 10000
CORRECTION = "Holm"


@dataclass
class Comparison:
    """Method ``method`` against ``reference`` in one (arch, condition)."""

    arch: str
    condition: str
    reference: str
    method: str
    seeds: list[int]
    speakers: int          # evaluation speakers (the same for every seed)
    delta: float
    ci_low: float
    ci_high: float
    p: float               # two-sided p of ``test``
    test: str              # which test gave p
    p_sign_flip: float     # exact sign-flip over seeds (NaN with one seed)
    p_holm: float = math.nan  # p after Holm over the table's comparisons
    level: float = LEVEL
    resamples: int = RESAMPLES  # of the CI's bootstrap


@dataclass(frozen=True)
class PairedResult:
    """What :func:`paired_test` finds for one pair of methods."""

    delta: float
    ci_low: float
    ci_high: float
    p: float
    test: str
    p_sign_flip: float


def _speaker_table(run: Run) -> dict[str, tuple[float, float]]:
    if not run.eval_rows:
        raise UserError(f"{run.folder}: no eval.parquet; a paired comparison needs per-utterance rows")
    return speaker_sums(run.eval_rows)


def paired_units(ref: Sequence[Run], other: Sequence[Run]
                 ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """(seeds, errors of ref [S, K], errors of other [S, K], reference words [S, K]) over the
    seeds both have and the speakers they were scored on (columns: the sorted union of every
    seed's speakers; a speaker a seed did not score has 0 errors and 0 words there). A seed only
    one of them has (a grid still running) is left out, and the comparison says which seeds it
    paired."""
    by_seed_a = {r.seed: r for r in ref}
    by_seed_b = {r.seed: r for r in other}
    common = sorted(set(by_seed_a) & set(by_seed_b))
    if not common:
        raise UserError(f"{ref[0].method} has seeds {sorted(by_seed_a)}, {other[0].method} "
                        f"{sorted(by_seed_b)}: no seed in common, nothing pairs")
    tables = []
    for seed in common:
        a, b = _speaker_table(by_seed_a[seed]), _speaker_table(by_seed_b[seed])
        if set(a) != set(b) or any(a[k][1] != b[k][1] for k in a):
            raise UserError(f"{by_seed_a[seed].folder} and {by_seed_b[seed].folder} were scored "
                            "on different evaluation sets; they do not pair")
        tables.append((a, b))
    keys = sorted({k for a, _ in tables for k in a})
    ea = np.array([[a.get(k, (0.0, 0.0))[0] for k in keys] for a, _ in tables])
    eb = np.array([[b.get(k, (0.0, 0.0))[0] for k in keys] for _, b in tables])
    ww = np.array([[a.get(k, (0.0, 0.0))[1] for k in keys] for a, _ in tables])
    return common, ea, eb, ww


def paired_test(ea: np.ndarray, eb: np.ndarray, words: np.ndarray, resamples: int = RESAMPLES,
                seed: int = 0) -> PairedResult:
    """Δ, its hierarchical-bootstrap 95% CI and the two-sided p (module docstring) from per-seed
    speaker error counts ``ea``, ``eb`` and reference words ``words``, each [S, K]."""
    ea, eb, words = (np.asarray(x, dtype=float) for x in (ea, eb, words))
    d = eb - ea
    per_seed = d.sum(axis=1) / words.sum(axis=1)
    delta = float(per_seed.mean())
    n_seeds, n_speakers = d.shape
    low, high = percentile_interval(
        replicate_means(d, words, bootstrap_draws(n_seeds, n_speakers, resamples, seed)))
    if n_seeds >= 2:
        return PairedResult(delta, low, high, paired_t(per_seed), f"paired t, {n_seeds} seeds",
                            sign_flip_exact(per_seed))
    return PairedResult(delta, low, high, sign_flip_units(d[0], words[0], resamples, seed),
                        f"sign-flip over {n_speakers} speakers (1 seed)", math.nan)


def compare(runs: Sequence[Run], reference: str, resamples: int = RESAMPLES,
            level: float = LEVEL) -> list[Comparison]:
    """Every method against ``reference`` (a method label, e.g. ``flat``) per (arch, condition),
    with Holm's correction across all of the returned comparisons (one table)."""
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
            res = paired_test(ea, eb, ww, resamples)
            out.append(Comparison(arch, cond, reference, method, seeds, int(ww.shape[1]),
                                  res.delta, res.ci_low, res.ci_high, res.p, res.test,
                                  res.p_sign_flip, level=level, resamples=resamples))
    if not out:
        known = sorted({m for _, _, m in cells}, key=method_key)
        raise UserError(f"--against {reference}: no cell has that method and another to compare; "
                        f"methods: {', '.join(known)}")
    for c, adjusted in zip(out, holm([c.p for c in out])):
        c.p_holm = adjusted
    return out


def verdict(c: Comparison) -> str:
    """``worse`` / ``better`` when the two-sided test rejects at ``c.level`` after Holm, with the
    sign of Δ; else ``within noise``."""
    if math.isfinite(c.p_holm) and c.p_holm < c.level:
        return "worse" if c.delta > 0 else "better"
    return "within noise"


def describe(rows: Sequence[Comparison]) -> str:
    """The statistics of a comparison table in one paragraph: level, correction, tests."""
    level = rows[0].level if rows else LEVEL
    resamples = rows[0].resamples if rows else RESAMPLES
    seeds = sorted({len(c.seeds) for c in rows})
    floor = ", ".join(f"{2.0 ** (1 - n):.3g} with {n} seeds" for n in seeds if n >= 2)
    return (f"Paired against the reference method: Δ WER = method − reference (mean over seeds); "
            f"95% CI by hierarchical bootstrap (seeds resampled, and speakers with one draw "
            f"shared by both methods and every seed; {resamples} resamples); p two-sided, from a "
            f"paired t-test over the per-seed differences (the seed is the unit of replication; "
            f"with 1 seed a sign-flip over that run's speakers, test-set sampling only); "
            f"{CORRECTION}-corrected across the {len(rows)} comparisons of this table; verdict at "
            f"level {level:g} on the corrected p. The exact sign-flip p over seeds is shown for "
            f"reference" + (f" (its floor: {floor})." if floor else "."))


def comparisons_markdown(rows: Sequence[Comparison]) -> str:
    out = [describe(rows), "",
           "| arch | condition | method | reference | Δ WER | 95% CI | test | p | p (Holm) | "
           "p sign-flip (exact) | n seeds × speakers | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        out.append(f"| {c.arch} | {c.condition} | {c.method} | {c.reference} | {fmt(c.delta)} | "
                   f"[{fmt(c.ci_low, 3)}, {fmt(c.ci_high, 3)}] | {c.test} | {fmt(c.p, 4)} | "
                   f"{fmt(c.p_holm, 4)} | {fmt(c.p_sign_flip, 4)} | "
                   f"{len(c.seeds)} × {c.speakers} | {verdict(c)} |")
    return "\n".join(out) + "\n"


def comparisons_csv(rows: Sequence[Comparison]) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["arch", "condition", "method", "reference", "seeds", "n_seeds", "n_speakers",
                "delta_wer", "ci_low", "ci_high", "test", "p", "p_holm", "p_sign_flip_exact",
                "level", "correction", "comparisons", "verdict"])
    for c in rows:
        w.writerow([c.arch, c.condition, c.method, c.reference, " ".join(map(str, c.seeds)),
                    len(c.seeds), c.speakers, c.delta, c.ci_low, c.ci_high, c.test, c.p,
                    c.p_holm, c.p_sign_flip, c.level, CORRECTION, len(rows), verdict(c)])
    return buf.getvalue()
