"""Inside-pool allocation rules and their factory.

A rule gives each member group h of a pool a weight w_h > 0 with Σ_pool w_h = 1 (the policy sets
C_h = C·√(α_k·w_h)); ``flat`` rules instead mark the pool for one joint threshold. Static rules
are here; the adaptive ones (EMA, quantile) are in ``adaptive.py``. The probe rule's allocation
(C_h ∝ public probe norm m_h) is derived in ``clipping.py``'s docstring.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from cluster_fl.config import ConfigError, PrivacyConfig
from cluster_fl.groups import GroupSpec
from cluster_fl.privacy.adaptive import EmaWeights, QuantileWeights, normalise


class StaticWeights:
    """A fixed weight vector inside a pool (size, uniform, probe)."""

    adaptive = None
    flat = False

    def __init__(self, raw: Sequence[float]) -> None:
        self.w = normalise(raw)

    def weights(self) -> list[float]:
        return list(self.w)


class FlatRule:
    """One threshold C·√α_k for the pool's concatenated slice."""

    adaptive = None
    flat = True

    def __init__(self, n: int) -> None:
        self.w = [1.0 / n] * n  # only used to report; clipping uses the pool threshold

    def weights(self) -> list[float]:
        return list(self.w)


def load_probe_norms(path: str | None, names: Sequence[str]) -> list[float]:
    """Probe norms for ``names`` from JSON ``{group: mean_norm}`` (or ``{"norms": {...}}``)."""
    key = "privacy.probe_norms"
    if not path:
        raise ConfigError(key, "clipping 'probe' needs a JSON file of per-group probe norms")
    p = Path(path).expanduser()
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"cannot read {p}: {exc.__class__.__name__}") from None
    if isinstance(raw, dict) and isinstance(raw.get("norms"), dict):
        raw = raw["norms"]
    if not isinstance(raw, dict):
        raise ConfigError(key, f"{p} must map group name to mean norm")
    missing = [n for n in names if n not in raw]
    if missing:
        raise ConfigError(key, f"{p} has no norm for group(s) {', '.join(missing[:3])}")
    vals = [raw[n] for n in names]
    for n, v in zip(names, vals):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(key, f"norm of group {n!r} must be a positive number, got {v!r}")
    return [float(v) for v in vals]


def make_rule(rule: str, members: Sequence[GroupSpec], cfg: PrivacyConfig) -> Any:
    """The inside-pool rule object for ``rule`` over ``members``."""
    sizes = [float(g.numel) for g in members]
    if rule == "size":
        return StaticWeights(sizes)
    if rule == "uniform":
        return StaticWeights([1.0] * len(members))
    if rule == "flat":
        return FlatRule(len(members))
    if rule in ("ema", "size-ema", "uniform-ema"):
        base = [1.0] * len(members) if rule == "uniform-ema" else sizes
        return EmaWeights(base, decay=cfg.ema_decay, gamma=cfg.ema_gamma,
                          warmup_rounds=cfg.ema_warmup_rounds)
    if rule == "quantile":
        return QuantileWeights(sizes, target=cfg.quantile_target, lr=cfg.quantile_lr)
    if rule == "probe":
        norms = load_probe_norms(cfg.probe_norms, [g.name for g in members])
        return StaticWeights([m * m for m in norms])
    raise ValueError(f"unknown rule {rule!r}")
