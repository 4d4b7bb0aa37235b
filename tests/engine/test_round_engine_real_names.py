"""The round engine's core properties on the real tiny architecture's trainable groups.

The other engine tests use a toy layout (``enc.q.A``, ``conn.w``, ...). What decides pools,
layer units and thresholds is read from group names and components, so the properties that the
privacy claim rests on are checked again on the names a real model has
(``encoder.layers.0.self_attn.q_proj.lora_A``, ``connector.proj.weight``, ``decoder.model.layers...``),
per matrix and per layer (``privacy.grouping``):

- one client scaled by 1e6 moves each α-split pool by at most √α_k·C/n (tight) and the whole
  aggregate by at most C/n, for every single-pool method too;
- with zero updates the released mean is pure noise of variance σ²C²/n² (χ² interval);
- a NaN client contributes exactly zero.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import FakeRunner, chi2_interval, engine_config, flat, make_engine, norm

from cluster_fl.distributed import bitwise_differences

N = 5
FALSE_ALARM = 1e-6
SLACK = 1e-8


@pytest.fixture(scope="module")
def groups():
    from cluster_fl.config import load_config
    from cluster_fl.models.lora import describe_groups

    real = describe_groups(load_config(None, ["model.arch=whisper-tinyllama-tiny"]).model)
    assert {g.component for g in real} == {"encoder", "connector", "decoder"}
    assert any(g.name.startswith("encoder.layers.") and g.name.endswith("lora_A") for g in real)
    return real


def _update(groups, c: int, r: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * r + c)
    return {s.name: torch.randn(s.shape or (s.numel,), generator=g) * scale for s in groups}


def _mean(groups, extra, make) -> tuple[dict, dict]:
    cfg = engine_config(f"fl.clients_per_round={N}", *extra)
    engine = make_engine(cfg, FakeRunner(make), N, groups=groups)
    state = {s.name: torch.zeros(s.shape or (s.numel,), dtype=torch.float64) for s in groups}
    out = engine.run_round(1, state)
    return out.state, out.row


def _attack(groups, victim: int | None):
    def make(c: int, r: int) -> dict:
        u = _update(groups, c, r, 1e-4)
        return {k: v * 1e6 for k, v in u.items()} if c == victim else u
    return make


@pytest.mark.parametrize("grouping", ["matrix", "layer"])
@pytest.mark.parametrize("alpha", [0.05, 0.25])
def test_alpha_split_moves_each_pool_by_at_most_its_share_on_real_names(groups, grouping, alpha):
    extra = ("privacy.noise_multiplier=0", f"privacy.alpha={alpha}", f"privacy.grouping={grouping}")
    base, _ = _mean(groups, extra, _attack(groups, None))
    hit, _ = _mean(groups, extra, _attack(groups, 2))
    pools = {"encoder": [g.name for g in groups if g.component == "encoder"],
             "decoder": [g.name for g in groups if g.component != "encoder"]}
    for pool, names in pools.items():
        bound = math.sqrt(alpha if pool == "encoder" else 1 - alpha) / N
        moved = norm(flat(hit, names) - flat(base, names))
        assert 0.95 * bound <= moved <= bound + SLACK, (pool, moved, bound)
    every = [g.name for g in groups]
    assert norm(flat(hit, every) - flat(base, every)) <= 1.0 / N + SLACK


@pytest.mark.parametrize("grouping", ["matrix", "layer"])
@pytest.mark.parametrize("clipping", ["flat", "uniform", "size", "uniform-ema", "size-ema",
                                      "quantile"])
def test_every_single_pool_method_bounds_one_client_by_c_over_n_on_real_names(groups, grouping,
                                                                              clipping):
    extra = ("privacy.noise_multiplier=0", f"privacy.clipping={clipping}",
             f"privacy.grouping={grouping}")
    base, _ = _mean(groups, extra, _attack(groups, None))
    hit, _ = _mean(groups, extra, _attack(groups, 2))
    every = [g.name for g in groups]
    moved = norm(flat(hit, every) - flat(base, every))
    assert moved <= 1.0 / N + SLACK and moved > 0.5 / N, (clipping, grouping, moved)


def test_released_noise_has_variance_sigma2_c2_over_n2_on_real_names(groups):
    sigma, c = 0.7, 0.5
    state, _ = _mean(groups, (f"privacy.noise_multiplier={sigma}", f"privacy.clip_norm={c}"),
                     lambda k, r: {s.name: torch.zeros(s.shape or (s.numel,)) for s in groups})
    released = flat(state, [g.name for g in groups])
    lo, hi = chi2_interval(released.numel(), FALSE_ALARM)
    assert 0.9 < lo and hi < 1.1  # 121,536 coordinates: a tight interval
    ratio = float((released ** 2).mean()) / (sigma * c / N) ** 2
    assert lo < ratio < hi, (ratio, lo, hi)


def test_a_nan_client_contributes_exactly_zero_on_real_names(groups):
    victim, first = 3, groups[0].name

    def make(poisoned: bool):
        def f(c: int, r: int) -> dict:
            u = _update(groups, c, r, 0.05)
            if c == victim:
                u = {k: torch.zeros_like(v) for k, v in u.items()}
                if poisoned:
                    u[first].view(-1)[0] = float("nan")
            return u
        return f

    extra = ("privacy.noise_multiplier=0", "privacy.diagnostics=exact")
    poisoned, row = _mean(groups, extra, make(True))
    zeroed, _ = _mean(groups, extra, make(False))
    assert row["n_nonfinite"] == 1 and bitwise_differences(poisoned, zeroed) == []
