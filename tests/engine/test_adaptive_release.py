"""Adaptive clipping learns only from the noised release: the round engine hands
``policy.update`` the secure sum of the clients' statistics plus exactly the noise drawn for the
``stat`` stream (std ``policy.statistic_noise_std``, once per round), over the public
denominator -- never the exact sum. Checked by spying on the real engine's policy and regenerating
the research-mode noise from the seed and the run's id (the stream's scope)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import FakeRunner, engine_config, make_engine, random_update, zero_state

from cluster_fl.privacy import ResearchNoise


@pytest.mark.parametrize("clipping, inside", [("size-ema", "size"), ("quantile", "size"),
                                              ("alpha-split", "ema")])
def test_the_policy_consumes_the_exact_sum_plus_the_stat_noise_and_nothing_else(clipping, inside):
    cfg = engine_config(f"privacy.clipping={clipping}", f"privacy.inside_pool={inside}",
                        "privacy.stat_noise_multiplier=2.0", "privacy.noise_multiplier=1.0",
                        "privacy.ema_warmup_rounds=0", "fl.clients_per_round=4", "run.seed=3")
    engine = make_engine(cfg, FakeRunner(random_update), 4)
    policy, stats, consumed = engine.policy, [], []
    statistic, update = policy.statistic, policy.update
    policy.statistic = lambda res: stats.append(statistic(res)) or stats[-1]
    policy.update = lambda noised, denominator: (consumed.append((noised.clone(), denominator)),
                                                 update(noised, denominator))
    std = policy.statistic_noise_std
    assert std > 0
    state, noise = zero_state(), ResearchNoise(3)
    for r in range(1, 6):
        state = engine.run_round(r, state).state
        exact = torch.stack(stats[-4:]).sum(0)
        noised, denominator = consumed[-1]
        assert len(stats) == 4 * r and len(consumed) == r and denominator == 4.0
        drawn = noise.gaussian(tuple(exact.shape), std, round=r,
                               stream=f"{engine.noise_scope}/stat", dtype=torch.float64)
        # the exact sum and the noise went through the fixed-point secure sum (2^-32 steps)
        torch.testing.assert_close(noised, exact + drawn, rtol=0, atol=1e-8)
        assert (noised - exact).abs().max() > 10 * 2.0 ** -32 * 4  # noise, not rounding
