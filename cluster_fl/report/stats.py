"""Statistics of a multi-seed study, where the SEED is the unit of replication (DESIGN §13).

A cell of a study table is the runs of one method over seeds s = 1..S, each scored on the same
evaluation speakers k = 1..K: word errors E[s, k] and reference words W[s, k], each summed over
the speaker's utterances. A run's WER is Σ_k E[s, k] / Σ_k W[s, k]; a cell's is the mean over its
seeds. Two sources of uncertainty: training randomness (cohorts, client batches, noise, the
fresh connector's init -- all drawn from the seed) and the sampling of test speakers.

* **Hierarchical bootstrap** (the CIs, :func:`bootstrap_draws`, :func:`replicate_means`): one
  replicate draws S seeds with replacement and K speakers with replacement, and recomputes the
  statistic on them -- the mean over the drawn seeds of the drawn speakers' pooled WER (or of a
  paired difference). ONE speaker draw serves every seed and every method of the replicate: the
  test speakers are the same people in every run, so redrawing them per seed or per method
  averages their shared sampling error away and gives intervals that are too narrow. The draws
  depend only on (S, K, resamples, seed), so every cell of a table with the same seeds and
  speakers sees the same draws.
* **Seed-level paired test** (:func:`paired_t`): on the per-seed differences D_s = WER_B,s −
  WER_A,s (runs of one seed share their cohorts, batches and starting model), the
  two-sided paired t-test, t = mean(D) / (sd(D)/√S) with S − 1 degrees of freedom. It is the
  verdict's test because the exact sign-flip test over seeds (:func:`sign_flip_exact`,
  distribution-free, reported beside it) cannot go below p = 2/2^S: 0.0625 with 5 seeds, so it
  could never reject at 0.05, let alone after a correction. The t-test assumes the D_s are
  normal; each is an average over hundreds of utterances, and its false-alarm rate on simulated
  studies with per-seed random effects is checked in ``tests/report/test_study_stats.py``. Its
  population is training randomness on the fixed evaluation set; speaker sampling enters the CI.
* **One seed**: no seed-level test exists. The fallback (:func:`sign_flip_units`) is a two-sided
  sign-flip test over the speakers' paired error counts, which measures only test-set sampling
  given that one trained model; tables name the test they used.
* **Holm** (1979) step-down correction (:func:`holm`) across the comparisons of one table:
  family-wise false-alarm rate ≤ the level under any dependence between the comparisons (they
  share the reference method, so they are dependent).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats as scipy_stats

LEVEL = 0.05                 # two-sided level of a verdict, after Holm
EXACT_MAX_SEEDS = 16         # sign-flip over seeds by enumeration up to 2^16 patterns
MONTE_CARLO = 20000          # sign-flip resamples beyond that (and over speakers)


@dataclass(frozen=True)
class Draws:
    """Index draws of a hierarchical bootstrap: ``seeds`` [R, S] and ``speakers`` [R, K], both
    indices with replacement; replicate r uses the same speakers for every seed and method."""

    seeds: np.ndarray
    speakers: np.ndarray

    @property
    def resamples(self) -> int:
        return int(self.seeds.shape[0])


def bootstrap_draws(n_seeds: int, n_speakers: int, resamples: int, seed: int = 0) -> Draws:
    """The draws for S seeds and K speakers: speakers first, then seeds, from one generator, so
    two calls with the same (K, resamples, seed) share their speaker draws whatever S is."""
    if n_seeds < 1 or n_speakers < 1 or resamples < 1:
        raise ValueError(f"bootstrap_draws: need >= 1 seed, speaker and resample, got "
                         f"{n_seeds}, {n_speakers}, {resamples}")
    rng = np.random.default_rng(seed)
    speakers = rng.integers(0, n_speakers, size=(resamples, n_speakers))
    seeds = rng.integers(0, n_seeds, size=(resamples, n_seeds))
    return Draws(seeds=seeds, speakers=speakers)


def replicate_means(errors: np.ndarray, words: np.ndarray, draws: Draws) -> np.ndarray:
    """[R] statistics: per replicate, the mean over its drawn seeds of Σ errors / Σ words over its
    drawn speakers. ``errors`` (or paired error differences) and ``words`` are [S, K]; a seed
    whose drawn speakers have no words (speakers missing from that run) is left out of the
    replicate's mean, and a replicate with no such seed at all is NaN."""
    errors, words = np.asarray(errors, dtype=float), np.asarray(words, dtype=float)
    if errors.shape != words.shape or errors.ndim != 2:
        raise ValueError(f"errors {errors.shape} and words {words.shape} must both be [S, K]")
    num = errors[:, draws.speakers].sum(axis=-1)  # [S, R]
    den = words[:, draws.speakers].sum(axis=-1)
    ratio = np.divide(num, den, out=np.full(num.shape, np.nan), where=den > 0)
    picked = ratio[draws.seeds.T, np.arange(draws.resamples)]  # [S drawn, R]
    ok = np.isfinite(picked)
    counts = ok.sum(axis=0)
    total = np.where(ok, picked, 0.0).sum(axis=0)
    return np.divide(total, counts, out=np.full(total.shape, np.nan), where=counts > 0)


def percentile_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the finite ``values`` (NaN, NaN when there are none)."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return float(low), float(high)


def paired_t(differences: Sequence[float]) -> float:
    """Two-sided p of the paired t-test that the mean of the per-seed ``differences`` is 0 (S − 1
    degrees of freedom). NaN with fewer than 2 seeds. Differences that do not vary at all give
    p = 1 when they are all 0 and p = 0 otherwise (a difference without spread is exact)."""
    d = np.asarray(differences, dtype=float)
    if d.size < 2:
        return math.nan
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0 or sd < 1e-12 * max(abs(mean), 1e-300):
        return 1.0 if mean == 0.0 else 0.0
    t = mean / (sd / math.sqrt(d.size))
    return float(min(1.0, 2.0 * scipy_stats.t.sf(abs(t), df=d.size - 1)))


def sign_flip_exact(differences: Sequence[float], resamples: int = MONTE_CARLO, seed: int = 0
                    ) -> float:
    """Two-sided sign-flip p of the mean of the per-seed ``differences``: every one of the 2^S
    sign patterns (the observed one included) for S <= EXACT_MAX_SEEDS, else a seeded Monte Carlo
    estimate. Its floor is 2/2^S for a nonzero mean (the pattern and its mirror). NaN for S < 1."""
    d = np.asarray(differences, dtype=float)
    if d.size < 1:
        return math.nan
    observed = abs(float(d.mean()))
    tol = 1e-12 * max(observed, 1e-300) + 1e-15
    if d.size <= EXACT_MAX_SEEDS:
        signs = np.array(list(itertools.product((-1.0, 1.0), repeat=d.size)))
        stats = np.abs(signs @ d) / d.size
        return float(np.count_nonzero(stats >= observed - tol) / len(stats))
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(resamples, d.size))
    stats = np.abs(signs @ d) / d.size
    return float((1 + np.count_nonzero(stats >= observed - tol)) / (1 + resamples))


def sign_flip_units(differences: np.ndarray, words: np.ndarray, resamples: int = MONTE_CARLO,
                    seed: int = 0) -> float:
    """Two-sided sign-flip p over paired units (speakers of one run): under the null the two
    methods' error counts of a unit are exchangeable, so Σ ±d_u / Σ w_u is the null distribution
    of the WER difference; p = (1 + #{|Δ*| ≥ |Δ|}) / (1 + R). Conditional on the trained models:
    it measures test-set sampling, not training randomness."""
    d, w = np.asarray(differences, dtype=float).ravel(), np.asarray(words, dtype=float).ravel()
    total = float(w.sum())
    if d.size == 0 or total <= 0:
        return math.nan
    observed = abs(float(d.sum()) / total)
    tol = 1e-12 * max(observed, 1e-300) + 1e-15
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(resamples, d.size))
    stats = np.abs(signs @ d) / total
    return float((1 + np.count_nonzero(stats >= observed - tol)) / (1 + resamples))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the input order: with the m finite p's sorted ascending,
    p̃_(i) = max over j <= i of min(1, (m − j + 1)·p_(j)). Rejecting p̃ < level keeps the
    family-wise error at most the level. NaN entries stay NaN and do not count in m."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    m = finite.size
    running = 0.0
    for rank, i in enumerate(finite[np.argsort(p[finite], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * float(p[i])))
        out[i] = running
    return out.tolist()
