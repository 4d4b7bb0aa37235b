"""Canary clients on the release channel: an empirical ε lower bound held against the accountant.

Mechanism audited (one round, canary always in the cohort when inserted, i.e. q = 1, add/remove
neighbours): the aggregator releases

    R = Σ_i clip(Δ_i) + b·c + Z,      Z ~ N(0, s²·I) per coordinate,   b ∈ {0, 1}

where c is a canary built with the run's own thresholds: every group h gets a random direction
scaled to its threshold C_h, so ‖c‖ = √Σ C_h² = C -- the worst case the clipping policy allows.
The adversary (DP's: knows every other update) scores t = ⟨R − Σ_i clip(Δ_i), c⟩ / C, which is
N(0, s²) without the canary and N(C, s²) with it. When the engine adds what it claims (s = σC) this
is exactly the Gaussian mechanism with noise multiplier σ, whose ε the accountant computes as
``compute_epsilon(σ, sampling_rate=1, rounds=1, delta, sampling="poisson")`` (Poisson with q = 1 is
the plain Gaussian under add/remove; see :func:`accounted_epsilon`).

Z is not simulated when it can be measured: with uploads recorded, Z_r = n_r·release_r − Σ_i w_i
clip(Δ_i) is the noise the engine actually added in round r. Each trial takes one round and a fresh
canary direction (near-orthogonal in high dimension, so trials on the same Z_r are close to
independent). A planted bug -- noise under-scaled while the record claims σC -- therefore shows up
as an ε lower bound above the accountant's ε. Without uploads, Z is drawn from the recorded
noise_std and the report says the engine's noise was not tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import optimize
from scipy import stats as sps

from cluster_fl.audit.stats import EpsilonBound, epsilon_lower_bound


def accounted_epsilon(sigma: float, delta: float, accountant: str = "rdp") -> float:
    """The accountant's ε for ONE round of the Gaussian mechanism, q = 1, add/remove."""
    if sigma <= 0:
        return math.inf
    from cluster_fl.privacy.accounting import compute_epsilon

    return compute_epsilon(sigma, 1.0, 1, delta, accountant=accountant, sampling="poisson")


def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Tight ε of one Gaussian mechanism (Balle & Wang 2018): the reference beside the accountant."""
    if sigma <= 0:
        return math.inf
    mu = 1.0 / sigma

    def gap(e: float) -> float:
        return (sps.norm.cdf(-e / mu + mu / 2) - math.exp(min(e, 700)) *
                sps.norm.cdf(-e / mu - mu / 2) - delta)
    if gap(0.0) <= 0:
        return 0.0
    hi = 1.0
    while gap(hi) > 0 and hi < 1e4:
        hi *= 2
    return float(optimize.brentq(gap, 0.0, hi))


@dataclass
class CanaryResult:
    """One canary experiment and its comparison with the accountant."""

    bound: EpsilonBound
    accounted_epsilon: float
    exact_epsilon: float
    noise_source: str
    noise_std_claimed: float
    noise_std_measured: float | None
    verdict: str
    reason: str

    def to_dict(self) -> dict:
        """Plain dict for report.json."""
        d = dict(self.__dict__)
        d["bound"] = self.bound.to_dict()
        return d


def canary_vectors(thresholds: Sequence[float], sizes: Sequence[int], n: int,
                   rng: np.random.Generator) -> np.ndarray:
    """``n`` canaries [n, Σ sizes]: per group a random direction scaled to its threshold."""
    out = np.empty((n, int(sum(sizes))))
    s = 0
    for thr, size in zip(thresholds, sizes):
        d = rng.standard_normal((n, size))
        out[:, s:s + size] = thr * d / np.linalg.norm(d, axis=1, keepdims=True)
        s += size
    return out


def run_canaries(noise: np.ndarray, thresholds: Sequence[float], sizes: Sequence[int], *,
                 trials: int, sigma: float, clip_norm: float, delta: float, alpha: float,
                 accountant: str, noise_source: str, noise_scale: float = 1.0,
                 seed: int = 0) -> CanaryResult:
    """Canary trials on noise vectors ``noise`` [rounds, d] (measured or drawn); see module doc.

    ``noise_scale`` multiplies the noise (the dose of the canary's positive control: 0 = noise
    off). The verdict: ``fail`` when the lower bound exceeds the accountant's ε (a violation);
    ``underpowered`` when even perfect separation could not exceed it (too few trials to see a
    bug); ``pass`` otherwise.
    """
    rng = np.random.default_rng(seed)
    canaries = canary_vectors(thresholds, sizes, trials, rng)
    c_norm = float(np.sqrt(np.sum(np.square(thresholds))))
    which = np.arange(trials) % len(noise)
    present = rng.permutation(np.arange(trials) < trials // 2)
    released = noise_scale * noise[which] + present[:, None] * canaries
    scores = np.einsum("ij,ij->i", released, canaries) / c_norm
    bound = epsilon_lower_bound(scores[present], scores[~present], delta, alpha)
    acc = accounted_epsilon(sigma, delta, accountant)
    exact = exact_gaussian_epsilon(sigma, delta)
    measured = float(np.sqrt(np.mean(np.square(noise)))) * noise_scale
    if bound.epsilon_lb > acc:
        verdict, reason = "fail", "empirical ε lower bound exceeds the accounted ε"
    elif bound.ceiling <= acc:
        verdict, reason = "underpowered", (f"{trials} trials can certify at most ε = "
                                           f"{bound.ceiling:.2f} < accounted {acc:.2f}")
    else:
        verdict, reason = "pass", "lower bound within the accounted ε"
    return CanaryResult(bound, acc, exact, noise_source, sigma * clip_norm, measured,
                        verdict, reason)
