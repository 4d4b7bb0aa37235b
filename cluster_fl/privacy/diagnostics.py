"""The per-round diagnostics release: what is released, its sensitivity, its noise, its cost.

Per-round diagnostics (loss, pre-clip norms, clip flags, retained ratios per pool, counters) are
statistics of clients' private updates, so they are a DP release like the update, bounded, noised
and accounted here in one place. Each trained client contributes one diagnostic vector; the round
engine adds the vectors to the secure sum beside the updates and rank 0 adds the noise once.
``privacy.diagnostics`` chooses the release:

* ``noised`` (default): every entry is bounded to [0, 1] (norms as fractions of C, loss as a
  fraction of ``LOSS_SCALE``), so one client's vector has L2 norm ≤ √D -- the sensitivity; the
  sum gets N(0, (z_d·√D)²) with z_d = ``privacy.diagnostics_noise_multiplier``, and the accountant
  composes it with the update on the same cohort (:func:`release_multiplier`);
* ``exact``: exact values and per-group norms for research figures; nothing is noised and the
  run records its guarantee as void (``privacy.accounting.ledger_for``);
* ``off``: nothing is released but the update. The vector is empty: nothing about the clients
  enters the secure sum beside the update, the metrics row carries no statistic of them, and the
  accountant charges nothing for diagnostics.

Means divide by the public denominator (n, or q·N under Poisson sampling), never by a realised
count; the counters (trained, skipped, non-finite) are released as their noised sums, from which
a reader may estimate counts (free post-processing). Exact mode (void) divides by the exact
number of trained clients. Non-private runs (``privacy.mechanism: none``) release exact
diagnostics unless ``off``.

Sensitivity survives the secure sum's fixed-point encoding: an entry in [0, 1] rounds to a
multiple of 2^-f in [0, 1] (0 and 1 are on the grid), so the encoded vector still has L2 ≤ √D.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from cluster_fl.config import PrivacyConfig
from cluster_fl.groups import GroupSpec

LOSS_SCALE = 10.0  # noised mode reports min(loss / 10, 1)
EXACT_BOUND = 1e4  # exact mode: entries are clamped to [-1e4, 1e4] for the fixed-point sum
COUNTERS = ("trained", "skipped", "nonfinite")  # summed (and noised) unless ``off``


def release_multiplier(privacy: PrivacyConfig) -> float | None:
    """z_d of the diagnostics release, relative to its sensitivity √D, for the accountant: the
    configured multiplier when diagnostics are noised, None when nothing noised is released
    (``exact`` is void instead, ``off`` releases nothing, a non-private run has no guarantee)."""
    if privacy.mechanism != "gaussian" or privacy.diagnostics != "noised":
        return None
    return float(privacy.diagnostics_noise_multiplier)


@dataclass
class Measured:
    """Norms of an unclipped update (non-private runs), shaped like a policy's clip result."""

    update: dict[str, torch.Tensor]
    group_norms: dict[str, float]
    pool_norms: dict[str, float]
    pool_clipped: dict[str, bool] = field(default_factory=dict)
    pool_retained: dict[str, float] = field(default_factory=dict)
    total_norm: float = 0.0
    nonfinite: bool = False


class Diagnostics:
    """Layout, bounding, noise scale and decoding of the diagnostic vector."""

    def __init__(self, groups: Sequence[GroupSpec], policy: Any, privacy: PrivacyConfig):
        self.groups = list(groups)
        self.private = privacy.mechanism == "gaussian"
        self.mode = ("off" if privacy.diagnostics == "off" else
                     privacy.diagnostics if self.private else "exact")
        self.exact = self.mode == "exact"
        self.clip_norm = privacy.clip_norm
        self.pools = [p.name for p in policy.pools] if self.private else ["all"]
        self.head = list(COUNTERS) if self.mode != "off" else []
        if self.mode != "off":
            self.head += ["loss", "total_norm", "any_clipped"]
        self.per_pool = ["clipped", "retained", "norm"] if self.mode != "off" else []
        self.names = list(self.head)
        for p in self.pools:
            self.names += [f"{k}/{p}" for k in self.per_pool]
        if self.exact:
            self.names += [f"norm/{g.name}" for g in self.groups]
        self.size = len(self.names)
        # one client's bounded vector has L2 norm <= sqrt(D): the release's sensitivity
        self.sensitivity = math.sqrt(self.size)
        multiplier = release_multiplier(privacy)
        self.noise_std = multiplier * self.sensitivity if multiplier is not None else 0.0
        self.bound = EXACT_BOUND if self.exact else 1.0

    def _bound(self, x: float, scale: float) -> float:
        if not math.isfinite(x):  # a non-finite client is counted by its flag, not its norm
            return 0.0
        return min(x, EXACT_BOUND) if self.exact else min(max(x / scale, 0.0), 1.0)

    def skipped(self) -> torch.Tensor:
        v = torch.zeros(self.size, dtype=torch.float64)
        v[self.names.index("skipped")] = 1.0
        return v

    def measure(self, delta: Mapping[str, torch.Tensor], max_abs: float = math.inf) -> Measured:
        """Norms of an update that is not clipped (mechanism ``none``); non-finite → zero."""
        return self.measure_many([delta], max_abs)[0]

    def measure_many(self, deltas: Sequence[Mapping[str, torch.Tensor]],
                     max_abs: float = math.inf) -> list[Measured]:
        """:meth:`measure` of a block's updates: every norm and peak of every client read back
        in one transfer (one host synchronisation per block, not two per tensor)."""
        parts = [torch.stack([delta[k].double().norm(),
                              delta[k].double().abs().max() if delta[k].numel()
                              else delta[k].new_zeros((), dtype=torch.float64)])
                 for delta in deltas for k in delta]
        stats = torch.stack(parts).tolist() if parts else []
        out, at = [], 0
        for delta in deltas:
            mine, at = stats[at:at + len(delta)], at + len(delta)
            out.append(self._measured(delta, mine, max_abs))
        return out

    def _measured(self, delta: Mapping[str, torch.Tensor], stats: Sequence[Sequence[float]],
                  max_abs: float) -> Measured:
        names = list(delta)
        norms = {k: n for k, (n, _) in zip(names, stats)}
        total = math.sqrt(sum(n * n for n in norms.values()))
        biggest = max((top for k, (_, top) in zip(names, stats) if delta[k].numel()), default=0.0)
        # a coordinate beyond the fixed-point range is a diverged client: dropped and counted
        # like a non-finite one instead of failing the run
        if not math.isfinite(total) or not biggest <= max_abs:
            zero = {k: torch.zeros_like(v) for k, v in delta.items()}
            return Measured(zero, norms, {"all": total}, total_norm=total, nonfinite=True)
        return Measured(dict(delta), norms, {"all": total}, {"all": False}, {"all": 1.0}, total)

    def client_vector(self, res: Any, loss: float) -> torch.Tensor:
        if self.mode == "off":
            return torch.zeros(0, dtype=torch.float64)
        v = [1.0, 0.0, float(bool(res.nonfinite))]
        if self.mode != "off":
            v += [self._bound(loss, LOSS_SCALE),
                  self._bound(float(res.total_norm), self.clip_norm),
                  float(any(bool(res.pool_clipped.get(p, False)) for p in self.pools))]
            for p in self.pools:
                retained = float(res.pool_retained.get(p, 1.0))
                v += [float(bool(res.pool_clipped.get(p, False))),
                      retained if math.isfinite(retained) else 0.0,
                      self._bound(float(res.pool_norms.get(p, 0.0)), self.clip_norm)]
        if self.exact:
            v += [self._bound(float(res.group_norms.get(g.name, 0.0)), 1.0) for g in self.groups]
        out = torch.tensor(v, dtype=torch.float64)
        if not self.exact:  # belt and braces: the bound the accountant assumes
            out = out.clamp(0.0, 1.0)
        return out

    def row(self, total: torch.Tensor | None, thresholds: Mapping[str, float],
            denominator: float) -> dict:
        """Decode a (noised) summed vector into a metrics row of means over the public
        ``denominator`` (exact mode: over the exact number trained). With ``off`` the row holds
        no statistic of the clients, only the (public) thresholds."""
        if self.mode == "off":
            row: dict[str, Any] = {"diagnostics": "off"}
        else:
            if total is None:
                raise ValueError(f"diagnostics {self.mode!r} need the summed vector")
            row = self._means(dict(zip(self.names, total.tolist())), denominator)
        for name, c in thresholds.items():
            row[f"threshold/{name}"] = float(c)
        return row

    def _means(self, s: dict[str, float], denominator: float) -> dict[str, Any]:
        div = max(s["trained"], 1.0) if self.exact else float(denominator)
        row: dict[str, Any] = {
            "n_clients": s["trained"], "n_skipped": s["skipped"], "n_nonfinite": s["nonfinite"],
            "loss": s["loss"] / div * (1 if self.exact else LOSS_SCALE),
            "total_norm": s["total_norm"] / div * (1 if self.exact else self.clip_norm),
            "clip_rate": s["any_clipped"] / div,
            "diagnostics": self.mode,
            "diag_noise_std": self.noise_std / div,
        }
        for p in self.pools:
            row[f"clip_rate/{p}"] = s[f"clipped/{p}"] / div
            row[f"retained/{p}"] = s[f"retained/{p}"] / div
            row[f"mean_norm/{p}"] = s[f"norm/{p}"] / div * (1 if self.exact else self.clip_norm)
        if self.exact:
            for g in self.groups:
                row[f"norm/{g.name}"] = s[f"norm/{g.name}"] / div
        return row
