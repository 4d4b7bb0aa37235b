"""Adaptive allocation rules inside a pool (EMA weights, per-group quantile clipping) and the
bounded per-client statistics they learn from.

A rule gives each member group h of a pool a weight w_h ≥ 0 with Σ_h w_h = 1; the policy turns it
into a threshold C_h = C·√(share·w_h). Static rules (size, uniform, probe) live in ``rules.py``;
the two rules here change their weights once per round from an *aggregate* statistic.

Threat model and sensitivity. The statistic read by an adaptive rule is a channel about clients'
private updates. With ``privacy.adaptive_private`` (the default) every client contributes a vector
whose L2 norm is bounded by a stated sensitivity Δ_s, the aggregator adds N(0, (z_s·Δ_s)²) ONCE to
the sum over clients, and the accountant composes that release with the update's Gaussian release
(same cohort, so the pair is one Gaussian with σ_eff = (σ⁻² + z_s⁻²)^(-1/2)). The rules below only
ever see that noised sum (plus the public denominator), so their weights are post-processing.

* EMA (``norm_statistic``): the vector of the client's per-group pre-clip norms, scaled jointly so
  its L2 norm is ≤ ``stat_clip`` (Δ_s = stat_clip under add/remove-one).
* Quantile (``indicator_statistic``, Andrew et al. 2021, "Differentially private learning with
  adaptive clipping"): per group the centred indicator b_h − ½ with b_h = 1 if ‖Δ_h‖ ≤ C_h, so the
  vector has L2 norm ≤ √H/2 (Δ_s = √H/2). Centring keeps the sensitivity at ½ per coordinate.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

# Weights are floored so a group never gets an exactly-zero threshold (which would make its
# effective noise multiplier infinite and its update vanish for good).
WEIGHT_FLOOR = 1e-12


def normalise(values: Sequence[float]) -> list[float]:
    """Non-negative values scaled to sum to 1 (uniform if they sum to 0); floored at WEIGHT_FLOOR."""
    vals = [max(float(v), 0.0) if math.isfinite(v) else 0.0 for v in values]
    total = math.fsum(vals)
    if total <= 0.0:
        return [1.0 / len(vals)] * len(vals)
    vals = [max(v / total, WEIGHT_FLOOR) for v in vals]
    total = math.fsum(vals)
    return [v / total for v in vals]


class EmaWeights:
    """w_h ∝ base_h · EMA_h^γ, where EMA_h is the exponential moving average of the mean client
    pre-clip norm of group h. Base weights are used for the first ``warmup_rounds`` rounds (the
    EMA still accumulates during warm-up); the EMA starts at the first observation (no zero bias).
    """

    adaptive = "ema"
    flat = False

    def __init__(self, base: Sequence[float], *, decay: float, gamma: float,
                 warmup_rounds: int) -> None:
        self.base = normalise(base)
        self.decay = float(decay)
        self.gamma = float(gamma)
        self.warmup_rounds = int(warmup_rounds)
        self.ema: list[float] | None = None
        self.rounds_seen = 0

    def weights(self) -> list[float]:
        """Current weights (sum to 1)."""
        if self.ema is None or self.rounds_seen < self.warmup_rounds:
            return list(self.base)
        return normalise([b * e ** self.gamma for b, e in zip(self.base, self.ema)])

    def observe(self, mean_norms: Sequence[float]) -> None:
        """One round's (noised) mean client norm per member group."""
        # A noised mean can be ≤ 0 for a group whose norms are tiny against the noise; a small
        # positive floor keeps EMA^γ defined and lets such a group fall to a small weight.
        floor = 1e-12
        obs = [max(float(m), floor) for m in mean_norms]
        if self.ema is None:
            self.ema = obs
        else:
            d = self.decay
            self.ema = [d * e + (1.0 - d) * o for e, o in zip(self.ema, obs)]
        self.rounds_seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"ema": None if self.ema is None else list(self.ema),
                "rounds_seen": self.rounds_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = None if state["ema"] is None else [float(x) for x in state["ema"]]
        self.rounds_seen = int(state["rounds_seen"])


class QuantileWeights:
    """Per-group geometric quantile tracking (Andrew et al. 2021): C_h ← C_h·exp(−η(b̄_h − γ)),
    b̄_h the (noised) fraction of clients whose group-h norm was ≤ C_h, γ the target unclipped
    fraction; then renormalised inside the pool so Σ C_h² keeps the pool's budget. In weight
    terms (w_h ∝ C_h²): w_h ← w_h·exp(−2η(b̄_h − γ)), normalised.
    """

    adaptive = "quantile"
    flat = False

    def __init__(self, initial: Sequence[float], *, target: float, lr: float) -> None:
        self.w = normalise(initial)
        self.target = float(target)
        self.lr = float(lr)
        self.rounds_seen = 0

    def weights(self) -> list[float]:
        """Current weights (sum to 1)."""
        return list(self.w)

    def observe(self, unclipped_fraction: Sequence[float]) -> None:
        """One round's (noised) unclipped fraction per member group, clamped to [0, 1]."""
        fr = [min(max(float(f), 0.0), 1.0) for f in unclipped_fraction]
        self.w = normalise([w * math.exp(-2.0 * self.lr * (f - self.target))
                            for w, f in zip(self.w, fr)])
        self.rounds_seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"w": list(self.w), "rounds_seen": self.rounds_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = [float(x) for x in state["w"]]
        self.rounds_seen = int(state["rounds_seen"])


def norm_statistic(group_norms: Sequence[float], stat_clip: float | None) -> list[float]:
    """EMA statistic of one client: its per-group pre-clip norms, jointly scaled to L2 ≤
    ``stat_clip`` (None = no bound: the non-private variant). Non-finite input → zeros."""
    norms = [float(n) for n in group_norms]
    if not all(math.isfinite(n) for n in norms):
        return [0.0] * len(norms)
    if stat_clip is None:
        return norms
    top = max(norms, default=0.0)
    if top <= 0.0:
        return [0.0] * len(norms)
    total = top * math.sqrt(math.fsum((n / top) ** 2 for n in norms))
    # Shrink a hair past the bound so float rounding can never push the vector over Δ_s.
    scale = min(1.0, stat_clip / total * (1.0 - 1e-12)) if total > 0 else 1.0
    return [n * scale for n in norms]


def indicator_statistic(unclipped: Sequence[bool] | None, n_groups: int) -> list[float]:
    """Quantile statistic of one client: b_h − ½ per group (L2 ≤ √H/2). ``None`` (a non-finite
    update) contributes the neutral zero vector."""
    if unclipped is None:
        return [0.0] * n_groups
    return [(1.0 if u else 0.0) - 0.5 for u in unclipped]
