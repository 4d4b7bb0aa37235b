"""Inside-pool allocation rules and their factory.

A rule gives each member unit u of a pool a weight w_u > 0 with Σ_pool w_u = 1 (the policy sets
C_u = C·√(α_k·w_u)); ``flat`` rules instead mark the pool for one joint threshold. A unit is a
clipping unit (``cluster_fl.groups.ClipUnit``): one group under ``privacy.grouping: matrix``, one
transformer layer under ``layer``; its size p_u is the sum of its groups' sizes. Static rules are
here; the adaptive ones (EMA, quantile) are in ``adaptive.py``. The probe rule's allocation
(C_u ∝ public probe norm m_u) is derived in ``clipping.py``'s docstring.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from cluster_fl.config import ConfigError, PrivacyConfig
from cluster_fl.groups import ClipUnit
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


def make_rule(rule: str, members: Sequence[ClipUnit], cfg: PrivacyConfig) -> Any:
    """The inside-pool rule object for ``rule`` over the pool's units ``members``."""
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
        # probe files hold per-group norms (``calibrate``); a unit's norm is that of its groups'
        # concatenation, m_u² = Σ_{h∈u} m_h², so w_u ∝ m_u² = Σ m_h²
        names = [h for u in members for h in u.members]
        norms = dict(zip(names, load_probe_norms(cfg.probe_norms, names)))
        return StaticWeights([math.fsum(norms[h] * norms[h] for h in u.members) for u in members])
    raise ValueError(f"unknown rule {rule!r}")
