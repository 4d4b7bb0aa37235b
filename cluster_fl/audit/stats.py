"""Audit statistics: exact binomial bounds, the pre-set gate, and the empirical ε lower bound.

Everything the audit decides goes through this file, so the decision rules are in one place:

* :func:`clopper_pearson` (exact, used for pass/fail) and :func:`wilson` (reported only);
* :func:`gate` -- attack accuracy minus a constant-guess baseline, one-sided upper Clopper–Pearson
  bound at level ``family_alpha / m`` (Bonferroni over the whole battery of ``m`` gated cells), fail
  above ``margin_pp``. A cell whose positive control did not fire is ``underpowered``, never ``pass``;
* :func:`epsilon_lower_bound` -- from canary scores with/without the canary, the largest ε that
  (ε, δ)-DP must satisfy at some threshold: TPR ≤ e^ε·FPR + δ and TNR ≤ e^ε·FNR + δ, with TPR/TNR at
  their lower and FPR/FNR at their upper Clopper–Pearson bounds (Jagielski et al. 2020, Nasr et al.
  2021). Every threshold searched costs one Bonferroni share, so the search itself cannot inflate ε.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
from scipy import stats as sps

VERDICTS = ("pass", "fail", "underpowered")


def clopper_pearson(k: int, n: int, alpha: float, side: str = "two") -> tuple[float, float]:
    """Exact binomial interval for k successes in n trials.

    ``side="two"`` puts alpha/2 in each tail; ``"upper"`` / ``"lower"`` give a one-sided bound at
    level alpha (the other end is 0 or 1). n = 0 gives the vacuous (0, 1).
    """
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside [0, n={n}]")
    tail = alpha / 2 if side == "two" else alpha
    lo = 0.0 if k == 0 else float(sps.beta.ppf(tail, k, n - k + 1))
    hi = 1.0 if k == n else float(sps.beta.ppf(1 - tail, k + 1, n - k))
    if side == "upper":
        lo = 0.0
    elif side == "lower":
        hi = 1.0
    return lo, hi


def wilson(k: int, n: int, alpha: float, side: str = "two") -> tuple[float, float]:
    """Wilson score interval (reported beside Clopper–Pearson; not used for decisions)."""
    if n <= 0:
        return 0.0, 1.0
    z = float(sps.norm.ppf(1 - (alpha / 2 if side == "two" else alpha)))
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    if side == "upper":
        lo = 0.0
    elif side == "lower":
        hi = 1.0
    return lo, hi


def bonferroni(family_alpha: float, m: int) -> float:
    """Per-test level that keeps the family-wise error rate ≤ family_alpha over m tests."""
    if m < 1:
        raise ValueError("a battery needs at least one gated test")
    return family_alpha / m


def constant_baseline(labels: Sequence) -> float:
    """Accuracy of always guessing the most frequent label of the evaluated set."""
    arr = np.asarray(labels)
    if arr.size == 0:
        return 0.0
    _, counts = np.unique(arr, return_counts=True)
    return float(counts.max() / arr.size)


@dataclass
class GateResult:
    """One gated measurement: accuracy vs constant baseline, bounds in percentage points."""

    correct: int
    n: int
    accuracy: float
    baseline: float
    excess_pp: float
    upper_cp_pp: float
    lower_cp_pp: float
    upper_wilson_pp: float
    level: float
    margin_pp: float
    verdict: str
    reason: str

    def to_dict(self) -> dict:
        """Plain dict for report.json."""
        return asdict(self)

    @property
    def fired(self) -> bool:
        """True when the leak is demonstrated: the lower bound on the excess exceeds the margin."""
        return self.lower_cp_pp > self.margin_pp


def gate(correct: int, n: int, baseline: float, *, m: int, family_alpha: float,
         margin_pp: float, positive_fired: bool | None = None,
         negative_clean: bool | None = None) -> GateResult:
    """The pre-set gate on one cell of the battery.

    Statistic: accuracy − baseline. Decision: ``fail`` when the one-sided upper CP bound (level
    family_alpha/m) of the excess exceeds ``margin_pp``; ``pass`` otherwise -- unless the cell's
    positive control did not fire (``positive_fired`` False) or its shuffled-label twin fired
    (``negative_clean`` False), which make a would-be pass ``underpowered``. A demonstrated leak
    (lower bound above the margin) is ``fail`` whatever the controls say.
    """
    level = bonferroni(family_alpha, m)
    acc = correct / n if n else 0.0
    _, hi = clopper_pearson(correct, n, level, "upper")
    lo, _ = clopper_pearson(correct, n, level, "lower")
    _, whi = wilson(correct, n, level, "upper")
    to_pp = lambda x: 100.0 * (x - baseline)  # noqa: E731 - tiny local helper
    res = GateResult(correct=correct, n=n, accuracy=acc, baseline=baseline,
                     excess_pp=to_pp(acc), upper_cp_pp=to_pp(hi), lower_cp_pp=to_pp(lo),
                     upper_wilson_pp=to_pp(whi), level=level, margin_pp=margin_pp,
                     verdict="pass", reason="upper bound within margin")
    if n == 0:
        res.verdict, res.reason = "underpowered", "no samples"
    elif res.lower_cp_pp > margin_pp:
        res.verdict, res.reason = "fail", "leak demonstrated (lower bound above margin)"
    elif res.upper_cp_pp > margin_pp:
        res.verdict, res.reason = "fail", "upper bound above margin (absence not shown)"
    elif positive_fired is False:
        res.verdict, res.reason = "underpowered", "positive control did not fire"
    elif negative_clean is False:
        res.verdict, res.reason = "underpowered", "shuffled-label control fired (biased probe)"
    return res


@dataclass
class EpsilonBound:
    """Empirical ε lower bound from a canary experiment."""

    epsilon_lb: float
    threshold: float | None
    tpr: float
    fpr: float
    n_in: int
    n_out: int
    thresholds_tried: int
    alpha: float
    ceiling: float

    def to_dict(self) -> dict:
        """Plain dict for report.json."""
        return asdict(self)


def epsilon_ceiling(n_in: int, n_out: int, alpha: float, thresholds: int, delta: float) -> float:
    """Largest ε the experiment could ever certify (perfect separation): its resolution."""
    each = alpha / (2 * thresholds)
    tpr_lo, _ = clopper_pearson(n_in, n_in, each, "lower")
    _, fpr_hi = clopper_pearson(0, n_out, each, "upper")
    return math.log(max(tpr_lo - delta, 1e-300) / fpr_hi) if tpr_lo > delta else 0.0


def epsilon_lower_bound(scores_in: Sequence[float], scores_out: Sequence[float], delta: float,
                        alpha: float = 0.05, thresholds: int = 16) -> EpsilonBound:
    """ε lower bound at confidence 1−alpha from canary scores (higher score = "canary present").

    ``thresholds`` candidate cut points are the quantiles of the pooled scores; each one spends
    alpha/(2·thresholds) on the TPR (or TNR) lower bound and the same on the FPR (or FNR) upper
    bound, so the max over thresholds holds at level alpha overall (Bonferroni).
    """
    s_in = np.sort(np.asarray(scores_in, dtype=float))
    s_out = np.sort(np.asarray(scores_out, dtype=float))
    n_in, n_out = len(s_in), len(s_out)
    pooled = np.concatenate([s_in, s_out])
    cuts = np.unique(np.quantile(pooled, np.linspace(0.02, 0.98, thresholds)))
    each = alpha / (2 * thresholds)
    best = EpsilonBound(0.0, None, 0.0, 0.0, n_in, n_out, thresholds, alpha,
                        epsilon_ceiling(n_in, n_out, alpha, thresholds, delta))
    for t in cuts:
        tp = int(n_in - np.searchsorted(s_in, t, side="left"))  # scores ≥ t flagged "in"
        fp = int(n_out - np.searchsorted(s_out, t, side="left"))
        tpr_lo, _ = clopper_pearson(tp, n_in, each, "lower")
        _, fpr_hi = clopper_pearson(fp, n_out, each, "upper")
        tnr_lo, _ = clopper_pearson(n_out - fp, n_out, each, "lower")
        _, fnr_hi = clopper_pearson(n_in - tp, n_in, each, "upper")
        for num, den in ((tpr_lo, fpr_hi), (tnr_lo, fnr_hi)):
            if num - delta > 0 and den > 0:
                eps = math.log((num - delta) / den)
                if eps > best.epsilon_lb:
                    best.epsilon_lb, best.threshold = eps, float(t)
                    best.tpr, best.fpr = tp / n_in, fp / n_out
    return best
