"""The study's statistics (cluster_fl.report.stats): hand examples for the bootstrap, the
exact sign-flip and Holm, and simulated studies WITH a per-seed random effect for the false-alarm
rate and the detection power of the seed-level paired t-test.

Every simulation is seeded, so these tests cannot flake; each states the binomial bound its
count is held to (probability of exceeding it at the nominal rate, computed with scipy)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
from scipy import stats as scipy_stats

from cluster_fl.report.stats import (bootstrap_draws, holm, paired_t, percentile_interval,
                                          replicate_means, sign_flip_exact, sign_flip_units)

LEVEL = 0.05


# ---- hand examples -----------------------------------------------------------------------------
def test_holm_matches_a_hand_computation():
    # sorted: 0.005*4 = 0.02; 0.01*3 = 0.03; 0.03*2 = 0.06; 0.04*1 = 0.04 -> running max 0.06.
    # At 0.05 Holm rejects the two smallest only, though all four raw p's are below 0.05.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # NaN is not a member of the family: m = 2 here
    out = holm([0.02, float("nan"), 0.04])
    assert out[0] == pytest.approx(0.04) and np.isnan(out[1]) and out[2] == pytest.approx(0.04)
    assert holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_exact_sign_flip_over_five_seeds_cannot_go_below_one_sixteenth():
    # all five differences positive: only the observed pattern and its mirror reach |mean| = 3
    assert sign_flip_exact([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)
    assert sign_flip_exact([1, -1]) == 1.0  # mean 0: every pattern is as extreme
    # one negative seed: patterns at least as extreme as |1+2+3+4-5| = 5 out of 32
    d = np.array([1, 2, 3, 4, -5.0])
    signs = np.array(np.meshgrid(*[[-1, 1]] * 5)).reshape(5, -1).T
    expected = np.mean(np.abs(signs @ d) >= 5 - 1e-12)
    assert sign_flip_exact(d) == pytest.approx(expected)


def test_paired_t_is_the_textbook_two_sided_one_sample_t_test():
    d = [0.012, 0.020, 0.004, 0.015, 0.009]
    assert paired_t(d) == pytest.approx(scipy_stats.ttest_1samp(d, 0.0).pvalue, rel=1e-9)
    assert np.isnan(paired_t([0.3]))  # one seed: no seed-level test
    assert paired_t([0.0, 0.0, 0.0]) == 1.0 and paired_t([0.1, 0.1, 0.1]) == 0.0


def test_hierarchical_bootstrap_resamples_seeds():
    # seed 0: every speaker at WER 0.2, seed 1: 0.4; speakers do not matter, seeds do: the
    # replicate mean is 0.2, 0.3 or 0.4 with probabilities 1/4, 1/2, 1/4, so the 95% interval is
    # [0.2, 0.4] (a bootstrap over speakers alone would say [0.3, 0.3])
    errors = np.array([[1.0, 2.0], [2.0, 4.0]])
    words = np.array([[5.0, 10.0], [5.0, 10.0]])
    draws = bootstrap_draws(2, 2, 4000)
    stats = replicate_means(errors, words, draws)
    assert set(np.round(stats, 12)) == {0.2, 0.3, 0.4}
    assert percentile_interval(stats) == pytest.approx((0.2, 0.4))
    assert np.mean(np.isclose(stats, 0.3)) == pytest.approx(0.5, abs=0.03)


def test_one_speaker_draw_serves_every_seed():
    # two seeds with identical speaker rows: with one speaker draw shared by both seeds every
    # replicate equals the one-seed replicate, so the interval is the one-seed interval exactly
    # (drawing speakers independently per seed would average two draws and narrow it)
    errors = np.array([[0.0, 2.0, 5.0, 1.0]])
    words = np.array([[10.0, 10.0, 10.0, 10.0]])
    two_e, two_w = np.repeat(errors, 2, axis=0), np.repeat(words, 2, axis=0)
    one = replicate_means(errors, words, bootstrap_draws(1, 4, 3000, seed=3))
    two = replicate_means(two_e, two_w, bootstrap_draws(2, 4, 3000, seed=3))
    np.testing.assert_allclose(one, two)
    independent = np.mean([replicate_means(errors, words, bootstrap_draws(1, 4, 3000, seed=s))
                           for s in (11, 12)], axis=0)
    assert np.std(independent) < 0.8 * np.std(two)  # what the old per-seed redraw did


def test_draws_are_shared_by_cells_with_the_same_speakers_whatever_their_seed_count():
    a, b = bootstrap_draws(5, 32, 100, seed=0), bootstrap_draws(4, 32, 100, seed=0)
    np.testing.assert_array_equal(a.speakers, b.speakers)


def test_speaker_sign_flip_of_one_run_is_two_sided():
    rng = np.random.default_rng(0)
    words = np.full(40, 50.0)
    d = rng.binomial(50, 0.2, 40) - rng.binomial(50, 0.2, 40) + 6.0  # B clearly worse
    assert sign_flip_units(d, words, 4000) < 0.001
    assert sign_flip_units(-d, words, 4000) < 0.001  # and clearly better: two-sided


# ---- simulated studies ------------------------------------------------------------------------
SPEAKERS, WORDS, SEEDS = 32, 120, 5
SEED_SD = 0.03          # per-seed effect shared by every method (cancels in a pair)
SEED_METHOD_SD = 0.01   # per-seed x method effect: training randomness the test must see
RUN_SPEAKER_SD = 0.02   # per run x speaker idiosyncrasy


def simulate(rng: np.random.Generator, shifts: Sequence[float], seeds: int = SEEDS):
    """One study: per method m (a WER shift each) the error counts [S, K] and the words [S, K].
    Speakers have their own rates (0.1-0.6), every seed moves all methods together (SEED_SD),
    and every (seed, method) has its own random effect (SEED_METHOD_SD) -- the per-seed random
    effect under which a test over pooled (seed, speaker) pairs raises false alarms."""
    base = rng.uniform(0.1, 0.6, size=SPEAKERS)
    seed_effect = rng.normal(0.0, SEED_SD, size=(seeds, 1))
    words = np.full((seeds, SPEAKERS), float(WORDS))
    out = []
    for shift in shifts:
        rate = (base + seed_effect + shift + rng.normal(0.0, SEED_METHOD_SD, size=(seeds, 1))
                + rng.normal(0.0, RUN_SPEAKER_SD, size=(seeds, SPEAKERS)))
        out.append(rng.binomial(WORDS, np.clip(rate, 0.0, 1.0)).astype(float))
    return out, words


def seed_differences(ea: np.ndarray, eb: np.ndarray, words: np.ndarray) -> np.ndarray:
    return (eb - ea).sum(axis=1) / words.sum(axis=1)


def binomial_bound(n: int, p: float, tail: float = 1e-4) -> int:
    """The count that n Bernoulli(p) trials exceed with probability < ``tail``."""
    return int(scipy_stats.binom.ppf(1.0 - tail, n, p))


def test_false_alarm_rate_holds_on_null_studies_with_a_per_seed_random_effect():
    """2,000 null studies (two methods from one distribution, per-seed random effects), paired
    t-test over 5 seeds at two-sided 0.05. At the exact level the rejections are Binomial(2000,
    0.05) (mean 100, sd 9.7): more than binomial_bound (138) happens with probability < 1e-4.
    The same data fool the old test (sign-flip over pooled seed x speaker pairs): on the first 200
    studies it rejects more often than a valid 5% test could (bound 23 of 200 at 1e-4; it rejects
    44), so this null carries the effect that matters."""
    rng = np.random.default_rng(2026)
    n, rejections, old = 2000, 0, 0
    for i in range(n):
        (ea, eb), words = simulate(rng, (0.0, 0.0))
        rejections += paired_t(seed_differences(ea, eb, words)) < LEVEL
        if i < 200:
            old += sign_flip_units(eb - ea, words, resamples=500, seed=i) < LEVEL
    assert rejections <= binomial_bound(n, LEVEL), rejections
    assert old > binomial_bound(200, LEVEL), old


def test_holm_keeps_the_family_wise_rate_over_a_table_of_null_comparisons():
    """1,000 null tables of 8 methods, each paired against the same reference (dependent tests).
    With Holm the tables with any false alarm are at most Binomial(1000, 0.05) (bound 77 at
    1e-4); uncorrected, the same tables raise a false alarm far more often."""
    rng = np.random.default_rng(7)
    n, fwer, raw = 1000, 0, 0
    for _ in range(n):
        errors, words = simulate(rng, (0.0,) * 9)
        p = [paired_t(seed_differences(errors[0], e, words)) for e in errors[1:]]
        fwer += min(holm(p)) < LEVEL
        raw += min(p) < LEVEL
    assert fwer <= binomial_bound(n, LEVEL), fwer
    assert raw >= 2 * binomial_bound(n, LEVEL), raw


def test_a_planted_effect_is_detected_after_holm_with_its_sign():
    """200 tables of 8 comparisons, one with a planted +0.08 WER (about the study's alpha 0.5 vs
    flat), seven null; detected after Holm in at least 90% of tables, never with the wrong sign."""
    rng = np.random.default_rng(11)
    n, found = 200, 0
    for _ in range(n):
        errors, words = simulate(rng, (0.0, 0.08) + (0.0,) * 7)
        d = [seed_differences(errors[0], e, words) for e in errors[1:]]
        adjusted = holm([paired_t(x) for x in d])
        if adjusted[0] < LEVEL:
            assert d[0].mean() > 0
            found += 1
    assert found >= 0.9 * n, found
