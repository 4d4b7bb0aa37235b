"""Audit statistics: exact bounds agree with scipy, the gate's verdict logic, the ε lower bound is
valid (never above the true ε of a Gaussian mechanism) and resolves a planted bug.

False-alarm rates: the bound tests are deterministic; the ε-validity test fails with probability
≤ 0.05 by construction of the bound (family level alpha=0.05), at a fixed seed it is deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from cluster_fl.audit.stats import (bonferroni, clopper_pearson, constant_baseline,
                                    epsilon_lower_bound, gate, wilson)


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (57, 400)])
def test_clopper_pearson_matches_scipy_exact_interval(k, n):
    ci = sps.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    lo, hi = clopper_pearson(k, n, 0.05)
    assert lo == pytest.approx(ci.low, abs=1e-9) and hi == pytest.approx(ci.high, abs=1e-9)
    wci = sps.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    wlo, whi = wilson(k, n, 0.05)
    assert wlo == pytest.approx(wci.low, abs=1e-9) and whi == pytest.approx(wci.high, abs=1e-9)


def test_one_sided_bound_uses_the_whole_alpha_in_one_tail():
    _, hi1 = clopper_pearson(5, 100, 0.05, "upper")
    _, hi2 = clopper_pearson(5, 100, 0.10, "two")
    assert hi1 == pytest.approx(hi2)


def test_gate_verdicts_follow_the_preset_rule():
    kw = dict(m=10, family_alpha=0.05, margin_pp=1.0)
    assert bonferroni(0.05, 10) == pytest.approx(0.005)
    leak = gate(900, 1000, 0.1, **kw)
    assert leak.verdict == "fail" and leak.fired
    clean = gate(2000, 20000, 0.1, **kw)  # exactly at baseline, large n
    assert clean.verdict == "pass" and clean.upper_cp_pp <= 1.0
    small = gate(10, 100, 0.1, **kw)  # at baseline but too few samples to show < margin
    assert small.verdict == "fail" and "absence not shown" in small.reason
    blind = gate(2000, 20000, 0.1, positive_fired=False, **kw)
    assert blind.verdict == "underpowered"
    biased = gate(2000, 20000, 0.1, negative_clean=False, **kw)
    assert biased.verdict == "underpowered"
    assert constant_baseline(["a", "a", "b", "c"]) == 0.5


def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """ε of one Gaussian mechanism with sensitivity/std = mu (Balle & Wang 2018)."""
    from scipy.optimize import brentq

    def f(e: float) -> float:
        return (sps.norm.cdf(-e / mu + mu / 2) - math.exp(e) * sps.norm.cdf(-e / mu - mu / 2)
                - delta)

    return brentq(f, 0.0, 500.0)


def test_epsilon_lower_bound_is_valid_and_sees_a_planted_bug():
    rng = np.random.default_rng(0)
    n, delta = 2000, 1e-5
    true_eps = _exact_gaussian_epsilon(1.0, delta)  # σ = 1 → ε ≈ 4.4 at δ = 1e-5
    ok = epsilon_lower_bound(rng.normal(1, 1, n), rng.normal(0, 1, n), delta)
    assert 0.0 < ok.epsilon_lb <= true_eps
    bug = epsilon_lower_bound(rng.normal(20, 1, n), rng.normal(0, 1, n), delta)  # σ/20
    assert bug.epsilon_lb > true_eps
    assert bug.epsilon_lb <= bug.ceiling + 1e-12
