"""Gaussian noise: variance within a χ² interval (false-alarm rate 1e-6 per test), research mode
reproducible and stream-separated, secure mode fresh every time and seed-refusing, dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2

from cluster_fl.config import PrivacyConfig
from cluster_fl.privacy import ResearchNoise, SecureNoise, make_noise, noise_for

FALSE_ALARM = 1e-6
N = 200_000


def chi2_interval_for_variance(n: int, std: float) -> tuple[float, float]:
    """Two-sided interval for Σx²/n of n draws of N(0, std²) with total false-alarm FALSE_ALARM.
    (Σx²/std² ~ χ²_n exactly since the mean is known to be 0.)"""
    lo = chi2.ppf(FALSE_ALARM / 2, n) / n
    hi = chi2.isf(FALSE_ALARM / 2, n) / n
    return lo * std ** 2, hi * std ** 2


@pytest.mark.parametrize("source", [ResearchNoise(seed=11), SecureNoise()],
                         ids=["research", "secure"])
@pytest.mark.parametrize("std", [0.05, 3.0])
def test_variance_within_chi2_interval(source, std):
    x = source.gaussian((N,), std, round=1, stream="update/g").double()
    lo, hi = chi2_interval_for_variance(N, std)
    var = float(x.pow(2).mean())
    assert lo <= var <= hi, (lo, var, hi)
    # mean: |x̄| ≤ z·std/√N with z for 1e-6 two-sided (≈ 4.89)
    assert abs(float(x.mean())) <= 4.9 * std / math.sqrt(N)


def test_research_mode_reproducible_and_streams_independent():
    a = ResearchNoise(seed=5).gaussian((1000,), 1.0, round=2, stream="update/x")
    b = ResearchNoise(seed=5).gaussian((1000,), 1.0, round=2, stream="update/x")
    assert torch.equal(a, b)
    others = [ResearchNoise(seed=6).gaussian((1000,), 1.0, round=2, stream="update/x"),
              ResearchNoise(seed=5).gaussian((1000,), 1.0, round=3, stream="update/x"),
              ResearchNoise(seed=5).gaussian((1000,), 1.0, round=2, stream="update/y")]
    for o in others:
        assert not torch.equal(a, o)
        # |corr| of 1000 independent pairs > 0.16 has probability < 1e-6
        assert abs(float(torch.corrcoef(torch.stack([a, o]))[0, 1])) < 0.16


def test_secure_mode_runs_differ_and_refuse_a_seed():
    a = SecureNoise().gaussian((100,), 1.0, round=1, stream="s")
    b = SecureNoise().gaussian((100,), 1.0, round=1, stream="s")
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="seed"):
        SecureNoise(seed=0)
    with pytest.raises(ValueError, match="seed"):
        make_noise(True, seed=1)
    assert noise_for(PrivacyConfig(secure_mode=True), run_seed=3).secure
    assert not noise_for(PrivacyConfig(secure_mode=False), run_seed=3).secure


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_release_never_below_float32(dtype):
    for src in (ResearchNoise(seed=0), SecureNoise()):
        out = src.gaussian((8,), 1e-3, round=1, stream="x", dtype=dtype)
        assert out.dtype == torch.promote_types(dtype, torch.float32)
        assert float(out.abs().sum()) > 0  # a tiny std survives: not rounded away in fp16


def test_zero_std_is_exact_and_negative_rejected():
    src = ResearchNoise(seed=0)
    assert torch.equal(src.gaussian((4,), 0.0, round=1, stream="x"), torch.zeros(4))
    with pytest.raises(ValueError):
        src.gaussian((4,), -1.0, round=1, stream="x")
