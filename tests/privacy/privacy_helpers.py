"""Shared helpers for the privacy tests: group layouts, configs, updates."""

from __future__ import annotations

import dataclasses
import math

import torch

from cluster_fl.config import PrivacyConfig
from cluster_fl.groups import GroupSpec

torch.set_num_threads(1)

POOLS_2 = ({"name": "enc", "components": ["encoder"], "share": 0.2},
           {"name": "rest", "components": ["connector", "decoder"], "share": 0.8})


def privacy(**kw) -> PrivacyConfig:
    """A PrivacyConfig with test defaults overridden by ``kw``."""
    base = dict(clip_norm=1.0, noise_multiplier=0.1)
    base.update(kw)
    if base.get("clipping") == "pools" and "pools" not in base:
        base["pools"] = POOLS_2
    return PrivacyConfig(**base)


def speech_groups(n_enc: int = 4, n_dec: int = 4, enc_numel: int = 32,
                  dec_numel: int = 96) -> list[GroupSpec]:
    """Encoder LoRA groups, two connector groups, decoder LoRA groups (encoder may be empty)."""
    gs = [GroupSpec(f"enc.{i}", "encoder", enc_numel, (enc_numel,)) for i in range(n_enc)]
    gs += [GroupSpec("conn.w", "connector", 64, (64,)), GroupSpec("conn.b", "connector", 8, (8,))]
    gs += [GroupSpec(f"dec.{i}", "decoder", dec_numel, (dec_numel,)) for i in range(n_dec)]
    return gs


def random_update(groups, scale=None, gen=None) -> dict[str, torch.Tensor]:
    """One client's update: component-dependent scales (encoder ~10× smaller by default)."""
    gen = gen or torch.Generator().manual_seed(0)
    scale = scale or {"encoder": 0.01, "connector": 0.1, "decoder": 0.1}
    return {g.name: torch.randn(g.numel, generator=gen) * scale[g.component] for g in groups}


def update_norm(update) -> float:
    return math.sqrt(math.fsum(float(t.double().pow(2).sum()) for t in update.values()))


def replace(cfg: PrivacyConfig, **kw) -> PrivacyConfig:
    return dataclasses.replace(cfg, **kw)
