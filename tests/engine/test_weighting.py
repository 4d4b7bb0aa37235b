"""``aggregation.weighting: samples``: client i counts w_i = min(n_i, cap)/cap ≤ 1.

Without privacy the released mean is the weighted mean Σ w_i Δ_i / Σ w_i; with DP it is
Σ w_i clip(Δ_i) / n over the public denominator n, so a prolific client never counts more than a
clipped update (sensitivity C); ``uniform`` is w_i = 1. Checked on the round engine with crafted
updates (noise off: σ = 0) against the formula computed here.
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import (FAKE_GROUPS, FakeRunner, engine_config, fake_clients, flat,
                            make_engine, random_update, zero_state)

from cluster_fl.privacy import make_policy

NAMES = [g.name for g in FAKE_GROUPS]
N_CLIENTS, CAP = 6, 5  # fake clients hold 3, 4, 5, 6, 3, 4 utterances: weights .6, .8, 1, 1, .6, .8


def _released(*extra: str) -> tuple[torch.Tensor, list[int]]:
    cfg = engine_config(f"fl.clients_per_round={N_CLIENTS}", f"aggregation.weight_cap={CAP}",
                        "privacy.noise_multiplier=0.0", *extra)
    runner = FakeRunner(lambda c, r: random_update(c, r, scale=0.05 * (1 + c)))
    out = make_engine(cfg, runner, N_CLIENTS).run_round(1, zero_state())
    return flat(out.state, NAMES), sorted(c for c, _ in runner.calls)


def _weights() -> list[float]:
    return [min(c.size, CAP) / CAP for c in fake_clients(N_CLIENTS)]


def test_without_privacy_the_release_is_the_sample_weighted_mean():
    got, trained = _released("privacy.mechanism=none", "aggregation.weighting=samples")
    assert trained == list(range(N_CLIENTS))
    w = _weights()
    assert len(set(w)) > 1  # the weights really differ
    expected = sum(wi * flat(random_update(c, 1, scale=0.05 * (1 + c)), NAMES)
                   for c, wi in enumerate(w)) / sum(w)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
    uniform, _ = _released("privacy.mechanism=none", "aggregation.weighting=uniform")
    assert not torch.allclose(uniform, got)


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_with_dp_each_clipped_update_is_weighted_and_divided_by_the_public_n(weighting):
    got, _ = _released(f"aggregation.weighting={weighting}")
    cfg = engine_config("privacy.noise_multiplier=0.0")
    policy = make_policy(cfg.privacy, FAKE_GROUPS)
    w = _weights() if weighting == "samples" else [1.0] * N_CLIENTS
    clipped = [flat(policy.clip(random_update(c, 1, scale=0.05 * (1 + c))).update, NAMES)
               for c in range(N_CLIENTS)]
    assert any(policy.clip(random_update(c, 1, scale=0.05 * (1 + c))).clipped
               for c in range(N_CLIENTS))
    expected = sum(wi * ci for wi, ci in zip(w, clipped)) / N_CLIENTS
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
