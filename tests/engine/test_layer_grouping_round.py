"""A round under ``privacy.grouping: layer`` through the unchanged engine: the update is clipped
per layer (the released sum is the sum of the policy's per-layer clips), the adaptive statistic
has one entry per layer, and every group's ``threshold/<group>`` column is its layer's."""

from __future__ import annotations

import torch

from engine_helpers import FakeRunner, engine_config, make_engine

from cluster_fl.groups import GroupSpec

LAYERED = [GroupSpec("encoder.layers.0.q.lora_A", "encoder", 24, (4, 6)),
           GroupSpec("encoder.layers.0.q.lora_B", "encoder", 12, (12,)),
           GroupSpec("connector.w", "connector", 16, (16,)),
           GroupSpec("decoder.model.layers.0.v.lora_A", "decoder", 20, (20,)),
           GroupSpec("decoder.model.layers.0.v.lora_B", "decoder", 8, (8,))]


def update(client: int, round_: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * round_ + client)
    return {s.name: torch.randn(s.shape, generator=g) * 0.3 for s in LAYERED}


def test_a_layer_grouped_round_clips_per_layer_and_reports_the_layers_thresholds():
    cfg = engine_config("fl.clients_per_round=4", "privacy.clipping=size-ema",
                        "privacy.grouping=layer", "privacy.noise_multiplier=0.0",
                        "privacy.clip_norm=0.5", "privacy.diagnostics=exact")
    engine = make_engine(cfg, FakeRunner(update), 6, groups=LAYERED)
    policy = engine.policy
    assert [u.name for u in policy.units] == ["encoder.layers.0", "connector",
                                              "decoder.model.layers.0"]
    assert engine.summer.fields["stat"].numel == 3  # one EMA entry per layer
    thresholds = policy.thresholds()
    state = {s.name: torch.zeros(s.shape, dtype=torch.float64) for s in LAYERED}
    out = engine.run_round(1, state)
    unit_thr = policy.unit_thresholds()
    for s in LAYERED:
        assert out.row[f"threshold/{s.name}"] == unit_thr[policy.unit_of()[s.name]] \
            == thresholds[s.name]
    members, _ = engine.cohort(1)
    clipped = [policy.clip(update(c, 1)).update for c in members]
    for s in LAYERED:  # σ = 0: the release is the mean of the per-layer clips (fixed point)
        expected = sum(c[s.name].double() for c in clipped) / len(members)
        assert torch.allclose(out.state[s.name], expected, atol=1e-8)
    assert 0 < out.row["clip_rate"] <= 1  # C = 0.5 binds on these updates (exact diagnostics)
