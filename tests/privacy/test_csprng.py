"""Secure mode's randomness: a ChaCha20 keystream under 256-bit OS keys, in counter mode.

- the stream is RFC 7539's ChaCha20 (the Appendix A.1 known-answer vector, block counter 0);
- uniforms and normals pass distribution tests (false-alarm rate 1e-6 per check), normals stay
  within the tail the secure sum reserves;
- secure noise is a function of its per-draw key alone (a fixed key reproduces it, torch's global
  generator does not reach it) and every draw asks the OS for a fresh 256-bit key;
- secure cohorts: Poisson membership at rate q (binomial interval), fixed size exactly m and
  uniform over clients (χ² over many rounds), the same key and round give every rank the same
  cohort, another key another one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import binom, chi2, kstest

from cluster_fl.privacy import SecureNoise, csprng
from cluster_fl.privacy.csprng import (MAX_NORMAL, ChaChaStream, draw_nonce, new_key,
                                       sample_cohort_secure)
from cluster_fl.privacy.noise import SECURE_DRAWS, TAIL_STDS

FALSE_ALARM = 1e-6


def test_the_keystream_is_rfc7539_chacha20():
    # RFC 7539 A.1, test vector #1: all-zero key and nonce, block counter 0
    words = ChaChaStream(bytes(32), bytes(12)).uint64(2)
    expected = bytes.fromhex("76b8e0ada0f13d90405d6ae55386bd28")
    assert words.astype("<u8").tobytes() == expected


def test_uniforms_and_normals_have_their_distributions():
    stream = ChaChaStream(new_key(), draw_nonce("test", 1))
    u = stream.uniform(200_000)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert kstest(u, "uniform").pvalue > FALSE_ALARM
    z = ChaChaStream(new_key(), draw_nonce("test", 2)).normal(200_001)
    assert z.shape == (200_001,)
    assert kstest(z, "norm").pvalue > FALSE_ALARM
    n = z.size  # Σz²/n with known mean 0: χ²_n / n
    lo, hi = chi2.ppf(FALSE_ALARM / 2, n) / n, chi2.isf(FALSE_ALARM / 2, n) / n
    assert lo < float(np.mean(z ** 2)) < hi
    assert np.abs(z).max() <= MAX_NORMAL
    # the sum-of-draws construction stays inside the fixed-point range the secure sum reserves
    assert SECURE_DRAWS * MAX_NORMAL / math.sqrt(SECURE_DRAWS) < TAIL_STDS


def test_secure_noise_is_a_function_of_a_fresh_256_bit_key_per_draw(monkeypatch):
    keys = []

    def fixed_key():
        keys.append(bytes(range(32)))
        return keys[-1]

    import cluster_fl.privacy.noise as noise_mod

    monkeypatch.setattr(noise_mod, "new_key", fixed_key)
    torch.manual_seed(1)
    a = SecureNoise().gaussian((1000,), 1.0, round=3, stream="update/g")
    torch.manual_seed(2)  # torch's global generator plays no part
    b = SecureNoise().gaussian((1000,), 1.0, round=3, stream="update/g")
    assert torch.equal(a, b) and len(keys) == 2 and all(len(k) == 32 for k in keys)
    c = SecureNoise().gaussian((1000,), 1.0, round=4, stream="update/g")  # the nonce names the draw
    assert not torch.equal(a, c)
    monkeypatch.undo()
    drawn = []
    real = csprng.new_key

    def spy():
        drawn.append(real())
        return drawn[-1]

    monkeypatch.setattr(noise_mod, "new_key", spy)
    SecureNoise().gaussian((10,), 1.0, round=1, stream="s")
    SecureNoise().gaussian((10,), 1.0, round=1, stream="s")
    assert len(drawn) == 2 and drawn[0] != drawn[1] and len(drawn[0]) * 8 >= 128


def test_secure_poisson_cohorts_have_rate_q():
    key, n, m, rounds = new_key(), 500, 40, 40
    sizes = [len(sample_cohort_secure(key, r, n, m, "poisson")) for r in range(1, rounds + 1)]
    total, trials = sum(sizes), n * rounds
    lo = binom.ppf(FALSE_ALARM / 2, trials, m / n)
    hi = binom.isf(FALSE_ALARM / 2, trials, m / n)
    assert lo <= total <= hi, (lo, total, hi)
    assert len(set(sizes)) > 1  # the realised size varies: it is a private count


def test_secure_fixed_cohorts_are_uniform_subsets_of_size_m():
    key, n, m, rounds = new_key(), 20, 5, 2000
    counts = np.zeros(n)
    for r in range(1, rounds + 1):
        cohort = sample_cohort_secure(key, r, n, m, "fixed")
        assert len(cohort) == m == len(set(cohort)) and cohort == sorted(cohort)
        counts[cohort] += 1
    expected = rounds * m / n
    stat = float(((counts - expected) ** 2 / expected).sum())
    # each client's count is binomial; the χ² statistic has n-1 degrees of freedom (slightly
    # conservative for sampling without replacement)
    assert stat < chi2.isf(FALSE_ALARM, n - 1), (stat, counts)


def test_every_rank_draws_the_same_cohort_from_the_shared_key_and_another_key_another():
    key = new_key()
    a = sample_cohort_secure(key, 7, 300, 30, "poisson")
    assert a == sample_cohort_secure(bytes(key), 7, 300, 30, "poisson")
    assert a != sample_cohort_secure(key, 8, 300, 30, "poisson")
    assert a != sample_cohort_secure(new_key(), 7, 300, 30, "poisson")
    with pytest.raises(ValueError):
        sample_cohort_secure(key, 1, 10, 3, "bogus")
