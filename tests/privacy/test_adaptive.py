"""Adaptive policies (EMA, quantile): bounded statistics, the cost shows up in the ledger, warm-up,
direction of adaptation, and bitwise state round trips. That the round engine hands the policy
the noised sum is tested on the engine (tests/engine/test_adaptive_release.py)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_fl.privacy import PrivacyLedger, ResearchNoise, make_policy
from privacy_helpers import privacy, random_update, speech_groups

ADAPTIVE = [("size-ema", "size"), ("uniform-ema", "size"), ("quantile", "size"),
            ("alpha-split", "ema"), ("pools", "ema")]


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from(ADAPTIVE), stat_clip=st.sampled_from([1e-3, 1.0, 50.0]),
       scale=st.sampled_from([0.0, 1e-8, 1.0, 1e30, math.nan, math.inf]))
def test_statistic_is_bounded_by_its_sensitivity(which, stat_clip, scale):
    groups = speech_groups()
    method, inside = which
    policy = make_policy(privacy(clipping=method, inside_pool=inside, stat_clip=stat_clip), groups)
    upd = random_update(groups, {"encoder": scale, "connector": 1.0, "decoder": 2.0})
    stat = policy.statistic(policy.clip(upd))
    assert stat.shape == (policy.statistic_size,) == (len(groups),)
    assert bool(torch.isfinite(stat).all())
    assert float(stat.norm()) <= policy.statistic_sensitivity * (1 + 1e-9)
    assert policy.statistic_noise_std == pytest.approx(1.0 * policy.statistic_sensitivity)


def test_static_policies_have_empty_statistic():
    policy = make_policy(privacy(clipping="size"), speech_groups())
    assert policy.adaptive is None and policy.statistic_size == 0
    assert policy.statistic(random_update(speech_groups())).numel() == 0
    assert policy.statistic_noise_std == 0.0
    policy.update(None, 1.0)  # a no-op, not an error


def one_round(policy, clients, noise, round_):
    """A driver for the policy tests below: clip, statistic, sum, noise, update. The round
    engine's own wiring of the noised statistic into ``policy.update`` is tested on the engine
    (tests/engine/test_adaptive_release.py)."""
    stats = [policy.statistic(policy.clip(u)) for u in clients]
    exact = torch.stack(stats).sum(0)
    noised = exact + noise.gaussian(exact.shape, policy.statistic_noise_std, round=round_,
                                    stream="stat", dtype=torch.float64)
    policy.update(noised, float(len(clients)))
    return exact, noised


@pytest.mark.parametrize("method,inside", ADAPTIVE)
def test_adaptive_cost_appears_in_ledger(method, inside):
    groups = speech_groups()
    cfg = privacy(clipping=method, inside_pool=inside, noise_multiplier=1.0)
    static = privacy(clipping="size", noise_multiplier=1.0)
    eps = {}
    for name, c in (("adaptive", cfg), ("static", static)):
        policy = make_policy(c, groups)
        ledger = PrivacyLedger(c, sampling_rate=0.01)
        for _ in range(20):
            ledger.step(policy)
        eps[name] = ledger.epsilon()
        assert ledger.guarantee == "simulation"  # research mode: ε of the mechanism
    assert eps["adaptive"] > eps["static"]
    assert ledger.to_json()["events"][0]["statistic_noise_multiplier"] is None


def test_nonprivate_adaptive_statistics_void_the_guarantee():
    groups = speech_groups()
    cfg = privacy(clipping="size-ema", adaptive_private=False, stat_clip=1e-3)
    policy = make_policy(cfg, groups)
    upd = random_update(groups, {"encoder": 1.0, "connector": 1.0, "decoder": 1.0})
    res = policy.clip(upd)
    # exact per-group norms, not clipped to stat_clip, and no noise
    assert torch.allclose(policy.statistic(res),
                          torch.tensor([res.group_norms[g.name] for g in groups],
                                       dtype=torch.float64))
    assert policy.statistic_noise_std == 0.0
    ledger = PrivacyLedger(cfg, sampling_rate=0.1)
    ledger.step(policy)
    rec = ledger.to_json()
    assert rec["guarantee"] == "void" and rec["epsilon"] is None
    assert "adaptive_private" in rec["void_reasons"][0]
    assert math.isinf(ledger.epsilon())


def test_ema_uses_base_weights_during_warmup_then_follows_norms():
    groups = speech_groups(n_enc=2, n_dec=2, enc_numel=50, dec_numel=50)
    cfg = privacy(clipping="uniform-ema", ema_warmup_rounds=3, stat_noise_multiplier=1e-3,
                  stat_clip=100.0)
    policy = make_policy(cfg, groups)
    base = policy.thresholds()
    clients = [random_update(groups, {"encoder": 0.01, "connector": 0.1, "decoder": 1.0},
                             gen=torch.Generator().manual_seed(i)) for i in range(3)]
    noise = ResearchNoise(seed=0)
    for r in range(1, 4):
        one_round(policy, clients, noise, r)
        if r < 3:
            assert policy.thresholds() == base
    after = policy.thresholds()
    assert after != base
    assert after["dec.0"] > base["dec.0"] and after["enc.0"] < base["enc.0"]
    assert math.fsum(v * v for v in after.values()) == pytest.approx(1.0, rel=1e-9)


def test_quantile_moves_thresholds_towards_clipped_groups():
    groups = speech_groups(n_enc=2, n_dec=2)
    cfg = privacy(clipping="quantile", stat_noise_multiplier=1e-3, quantile_target=0.5)
    policy = make_policy(cfg, groups)
    base = policy.thresholds()
    # the encoder is far below its threshold, the decoder far above: decoder should gain
    clients = [random_update(groups, {"encoder": 1e-5, "connector": 1e-5, "decoder": 10.0},
                             gen=torch.Generator().manual_seed(i)) for i in range(4)]
    noise = ResearchNoise(seed=0)
    for r in range(1, 6):
        one_round(policy, clients, noise, r)
    after = policy.thresholds()
    assert after["dec.0"] > base["dec.0"] and after["enc.0"] < base["enc.0"]
    assert math.fsum(v * v for v in after.values()) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("method,inside", ADAPTIVE)
def test_state_dict_round_trip_is_bitwise(method, inside):
    groups = speech_groups()
    cfg = privacy(clipping=method, inside_pool=inside, ema_warmup_rounds=1)
    gen = torch.Generator().manual_seed(7)
    clients = [random_update(groups, gen=gen) for _ in range(3)]
    a = make_policy(cfg, groups)
    for r in range(1, 4):
        one_round(a, clients, ResearchNoise(seed=5), r)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = make_policy(cfg, groups)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert b.thresholds() == a.thresholds()
    for r in range(4, 7):  # both continue identically
        one_round(a, clients, ResearchNoise(seed=5), r)
        one_round(b, clients, ResearchNoise(seed=5), r)
        assert b.thresholds() == a.thresholds()
    other = make_policy(privacy(clipping="size"), groups)
    with pytest.raises(ValueError):
        other.load_state_dict(a.state_dict())


def test_update_rejects_bad_input():
    policy = make_policy(privacy(clipping="quantile"), speech_groups())
    with pytest.raises(ValueError):
        policy.update(torch.zeros(3), 2.0)
    with pytest.raises(ValueError):
        policy.update(torch.zeros(policy.statistic_size), 0.0)
    with pytest.raises(ValueError):
        policy.update(torch.full((policy.statistic_size,), math.nan), 2.0)
