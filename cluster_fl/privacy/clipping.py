"""Clipping policies: one ``ClipPolicy`` class, pools of units, and a dict registry of builders.

A policy partitions the trainable groups into pools k with budget shares α_k (Σ α_k = 1). Inside
a pool the per-layer rules clip *units* (``privacy.grouping``, ``cluster_fl.groups.ClipUnit``):
``matrix`` (default) -- a unit is one group (a LoRA A or B matrix, a connector weight or bias);
``layer`` -- a unit is every group of one transformer layer of one component (q/k/v LoRA A and B
of decoder layer 3; the connector is one layer), the paper's per-layer clipping. A *rule* gives
each unit u a weight w_u (Σ_pool w_u = 1), the threshold is C_u = C·√(α_k·w_u), and a unit is
clipped as one vector: one norm ‖Δ_u‖ (of its groups' concatenation), one threshold, one scale
min(1, C_u/‖Δ_u‖) for every group of the unit. Σ_u C_u² = C² whatever the grouping (the units
partition the groups), so ‖clip(Δ)‖² = Σ_u ‖clip(Δ)_u‖² ≤ Σ_u C_u² = C²: the joint L2
sensitivity is C and the accountant is unchanged. A ``flat`` rule instead clips the pool's
concatenated slice to C_k = C·√α_k (flat clipping and pools do not depend on the grouping).

Reported thresholds (``thresholds()``, rounds.parquet ``threshold/<group>``, groups.json) are
per group: each group reports its unit's threshold C_u, the bound its unit was clipped to (under
``matrix`` the group's own, as before). With ``layer`` the per-group values are therefore not a
partition of C² (Σ_h C_h² ≥ C², every member repeats C_u); ``unit_thresholds()`` is, and
groups.json names each group's ``unit``, so a reader (the audit's canary) can rebuild it.

Sensitivity: for EVERY input, NaN/±Inf/1e30 included, ‖clip(Δ)‖₂ ≤ C. Norms are computed in
float64 with max-scaling (no overflow), a clipped group is scaled a hair (2⁻²⁰) below its
threshold so the final cast cannot round it over, and a non-finite update becomes all zeros
(``nonfinite=True``; the engine counts it). Output tensors keep their dtype, promoted to ≥ float32.

The sensitivity survives the secure sum's fixed-point encoding (round to the nearest multiple of
2^-f): rounding moves each of the d coordinates by at most 2^-(f+1), so the encoded update's norm
can exceed ‖x‖ by √d·2^-(f+1). :meth:`ClipPolicy.reserve_encoding` (the round engine calls it with
``aggregation.fixed_point_bits``) shrinks every threshold by that margin, κ = 1 − √d·2^-(f+1)/C, so
the ENCODED update has norm ≤ C, and refuses fractional bits that would take more than
``ENCODING_SHARE`` of C (e.g. 8 bits for a million parameters: +1.95 at C = 1). The adaptive
EMA statistic (L2 ≤ ``stat_clip``) reserves its own margin likewise; the quantile indicators
(±½) and the diagnostics (entries in [0, 1]) lie on the grid or round within their range.

Registry names are exactly ``config.CLIPPING_METHODS``. Rules:
* ``size``: w_u ∝ p_u (unit size);  ``uniform``: w_u = 1/|units in pool|;  ``flat``: one
  threshold per pool.
* ``uniform-ema``/``size-ema`` (and inside-pool ``ema`` = size-based EMA): see ``adaptive.py``.
* ``quantile``: per-unit adaptive quantile clipping (Andrew et al. 2021), starts from ``size``.
* ``probe``: static allocation from public probe norms m_u (``privacy.probe_norms``, per group;
  a layer's m_u² = Σ_{h∈u} m_h²): C_u ∝ m_u, i.e. w_u = m_u² / Σ m_k². Why: the Gaussian noise
  added to the sum is N(0, σ²C²) on every coordinate whatever the allocation, so the allocation
  only changes the clipping bias; with norms ≈ m_u, minimising Σ_u (m_u − C_u)₊² subject to
  Σ C_u² = C² gives C_u = m_u/(1+λ), i.e. thresholds proportional to the typical norms (every
  unit clipped by the same factor).
* The adaptive statistics (EMA norms, quantile indicators) have one entry per unit.
* ``alpha-split``: pool "encoder" (component encoder) gets α, pool "decoder" (connector, decoder
  and anything else) gets 1−α; inside rule ``privacy.inside_pool``.
* ``pools``: ``privacy.pools`` = [{name, components, share}], inside rule ``privacy.inside_pool``.

Empty pools (e.g. alpha-split with a frozen encoder: no encoder groups) are dropped and the
remaining shares renormalised to sum to 1 — so the decoder pool then receives the whole budget C²
and Σ C_h² = C² still holds. The policy records this in ``notes``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from cluster_fl.config import ConfigError, PrivacyConfig
from cluster_fl.groups import ClipUnit, GroupSpec, clipping_units
from cluster_fl.privacy.adaptive import indicator_statistic, norm_statistic
from cluster_fl.privacy.rules import make_rule

# A clipped group is scaled to threshold·(1 − MARGIN): float32 rounding (≤ 2⁻²⁴ relative) can
# then never lift it over its threshold.
MARGIN = 2.0 ** -20
# the share of C the fixed-point rounding may take before reserve_encoding refuses the bits
ENCODING_SHARE = 1e-3


def encoding_margin(numel: int, frac_bits: int) -> float:
    """The most round-to-nearest fixed point with ``frac_bits`` fractional bits can add to the L2
    norm of a ``numel``-coordinate vector: √numel · 2^-(frac_bits+1)."""
    return math.sqrt(max(numel, 0)) * 2.0 ** -(frac_bits + 1)


@dataclass(frozen=True)
class PoolSpec:
    """A pool: its ``name``, member group names (in policy order), budget ``share`` α_k, rule,
    and its clipping ``units`` (unit names in policy order; empty = one unit per group)."""

    name: str
    groups: tuple[str, ...]
    share: float
    rule: str
    units: tuple[str, ...] = ()


@dataclass
class ClipResult:
    """One client's clipped update and its (pre-clip) statistics.

    For a non-finite update: ``update`` is all zeros, ``nonfinite`` is True, every norm is NaN
    (exclude such clients from norm means), every clipped flag is True and retained is 0.
    """

    update: dict[str, torch.Tensor]
    group_norms: dict[str, float]
    group_clipped: dict[str, bool]
    group_thresholds: dict[str, float]
    pool_norms: dict[str, float]
    pool_clipped: dict[str, bool]
    pool_retained: dict[str, float]
    total_norm: float
    nonfinite: bool

    @property
    def clipped(self) -> bool:
        """Whether any group was clipped (the run's ``clip_rate`` counts this)."""
        return any(self.group_clipped.values())


def safe_norm(t: torch.Tensor) -> float:
    """L2 norm in float64 with max-scaling, so 1e300-sized entries do not overflow."""
    return norm_parts([t])[1][0]


def norm_parts(tensors: Sequence[torch.Tensor]) -> tuple[list[float], list[float]]:
    """``(max |x|, ‖x‖₂)`` of each tensor, both float64, with :func:`safe_norm`'s max-scaling and
    its exact values, read back from the device in ONE transfer (a client's tail then costs one
    host synchronisation, not three per tensor). ``max |x|`` is finite exactly when every entry
    is (NaN and ±Inf propagate through the max); the norm of a tensor whose max is 0 or not
    finite is that max, as in :func:`safe_norm`."""
    if not tensors:
        return [], []
    xs = [t.detach().to(torch.float64).reshape(-1) for t in tensors]
    tops = torch.stack([x.abs().max() if x.numel() else x.new_zeros(()) for x in xs])
    scaled = torch.stack([torch.linalg.vector_norm(x / top) for x, top in zip(xs, tops)])
    top_list, scaled_list = torch.stack([tops, scaled]).tolist()
    norms = [top if top == 0.0 or not math.isfinite(top) else top * sc
             for top, sc in zip(top_list, scaled_list)]
    return top_list, norms


def combine_norms(norms: Sequence[float]) -> float:
    """√(Σ n²) without overflow."""
    top = max(norms, default=0.0)
    if top == 0.0 or not math.isfinite(top):
        return top
    return top * math.sqrt(math.fsum((n / top) ** 2 for n in norms))


class ClipPolicy:
    """Per-pool clipping with thresholds C_u = C·√(α_k·w_u) per clipping unit; see the module
    docstring. Sensitivity: ‖clip(Δ)‖₂ ≤ C for every input and every grouping.

    ``units`` are the clipping units (default: one per group, ``matrix`` grouping); a pool's
    rule weighs its ``PoolSpec.units``. Adaptive policies (``adaptive`` is "ema" or "quantile")
    learn only from the noised sum of per-client statistics passed to :meth:`update`; static
    ones have ``statistic_size == 0``.
    """

    def __init__(self, method: str, groups: Sequence[GroupSpec],
                 pools: Sequence[tuple[PoolSpec, Any]], clip_norm: float, *,
                 units: Sequence[ClipUnit] | None = None,
                 adaptive_private: bool = True, stat_clip: float = 1.0,
                 stat_noise_multiplier: float = 1.0, notes: Sequence[str] = ()) -> None:
        self.method = method
        self.groups = tuple(groups)
        self.clip_norm = float(clip_norm)
        self.notes = tuple(notes)
        self.units = tuple(units) if units is not None else tuple(clipping_units(self.groups))
        self._pools = [p if p.units else dataclasses.replace(p, units=p.groups)
                       for p, _ in pools]
        self._rules = [r for _, r in pools]
        self._names = [g.name for g in self.groups]
        self._index = {n: i for i, n in enumerate(self._names)}
        self._members = {u.name: u.members for u in self.units}
        self._unit_names = [u.name for u in self.units]
        self._unit_index = {n: i for i, n in enumerate(self._unit_names)}
        self._unit_of = {h: u.name for u in self.units for h in u.members}
        if sorted(self._unit_of) != sorted(self._names) or \
                sum(len(u.members) for u in self.units) != len(self._names):
            raise ValueError("units must partition the groups exactly")
        covered = sorted(u for p in self._pools for u in p.units)
        if covered != sorted(self._unit_names):
            raise ValueError("pools must partition the units exactly")
        for p in self._pools:
            if sorted(p.groups) != sorted(h for u in p.units for h in self._members[u]):
                raise ValueError(f"pool {p.name!r}: groups are not its units' members")
        kinds = {r.adaptive for r in self._rules} - {None}
        if len(kinds) > 1:
            raise ValueError(f"a policy mixes adaptive rules {sorted(kinds)}")
        self.adaptive: str | None = kinds.pop() if kinds else None
        self.adaptive_private = bool(adaptive_private)
        self.stat_clip = float(stat_clip)
        self.stat_noise_multiplier = float(stat_noise_multiplier)
        self.rounds_updated = 0
        # reserve_encoding: thresholds shrink by κ, the EMA statistic's bound by its own margin
        self.encoding_bits: int | None = None
        self._kappa = 1.0
        self._stat_margin = 0.0

    def reserve_encoding(self, frac_bits: int) -> None:
        """Shrink the thresholds so that the update, once encoded in fixed point with
        ``frac_bits`` fractional bits, still has L2 norm ≤ C (module docstring). Refuses, naming
        ``aggregation.fixed_point_bits``, bits whose rounding would take more than
        ``ENCODING_SHARE`` of C. Idempotent for the same bits."""
        numel = sum(g.numel for g in self.groups)
        margin = encoding_margin(numel, frac_bits)
        if margin > ENCODING_SHARE * self.clip_norm:
            need = math.ceil(math.log2(math.sqrt(numel) / (2.0 * ENCODING_SHARE * self.clip_norm)))
            raise ConfigError("aggregation.fixed_point_bits",
                              f"{frac_bits} fractional bits are too few for {numel:,} trainable "
                              f"parameters at privacy.clip_norm {self.clip_norm:g}: rounding could "
                              f"add {margin:.3g} to a clipped update's norm (more than "
                              f"{ENCODING_SHARE:g} of C); use at least {need}")
        self.encoding_bits = int(frac_bits)
        self._kappa = 1.0 - margin / self.clip_norm
        if self.adaptive == "ema" and self.adaptive_private:
            self._stat_margin = encoding_margin(len(self._unit_names), frac_bits)
            if self._stat_margin > ENCODING_SHARE * self.stat_clip:
                raise ConfigError("aggregation.fixed_point_bits",
                                  f"{frac_bits} fractional bits are too few for the adaptive "
                                  f"statistic at privacy.stat_clip {self.stat_clip:g}")

    # ---- thresholds -------------------------------------------------------------------
    @property
    def threshold_scale(self) -> float:
        """κ: every threshold's share of its nominal value C·√(α_k·w_u) (1 until
        :meth:`reserve_encoding`)."""
        return self._kappa

    @property
    def pools(self) -> list[PoolSpec]:
        """The pools (name, member groups, share, rule)."""
        return list(self._pools)

    def pool_thresholds(self) -> dict[str, float]:
        """C_k = C·√α_k per pool (Σ C_k² = C²; times κ after :meth:`reserve_encoding`)."""
        return {p.name: self.clip_norm * self._kappa * math.sqrt(p.share) for p in self._pools}

    def unit_thresholds(self) -> dict[str, float]:
        """Current per-unit thresholds C_u, Σ_u C_u² = C² (a flat pool's units report the pool
        threshold; times κ after :meth:`reserve_encoding`)."""
        out: dict[str, float] = {}
        c = self.clip_norm * self._kappa
        for pool, rule in zip(self._pools, self._rules):
            if rule.flat:
                for u in pool.units:
                    out[u] = c * math.sqrt(pool.share)
            else:
                for u, w in zip(pool.units, rule.weights()):
                    out[u] = c * math.sqrt(pool.share * w)
        return {u: out[u] for u in self._unit_names}

    def thresholds(self) -> dict[str, float]:
        """Current per-group thresholds: each group reports its unit's threshold (a flat pool's
        groups the pool threshold); under ``matrix`` grouping Σ_h C_h² = C²."""
        unit = self.unit_thresholds()
        return {h: unit[self._unit_of[h]] for h in self._names}

    def unit_of(self) -> dict[str, str]:
        """Group name → clipping unit name."""
        return dict(self._unit_of)

    def pool_of(self) -> dict[str, str]:
        """Group name → pool name."""
        return {h: p.name for p in self._pools for h in p.groups}

    def group_table(self) -> list[dict[str, Any]]:
        """[{name, component, numel, pool, unit, threshold}] in group order (``groups.json``);
        ``threshold`` is the unit's."""
        thr, pool = self.thresholds(), self.pool_of()
        return [{"name": g.name, "component": g.component, "numel": g.numel,
                 "pool": pool[g.name], "unit": self._unit_of[g.name], "threshold": thr[g.name]}
                for g in self.groups]

    def _unit_norms(self, norms: Mapping[str, float]) -> dict[str, float]:
        """‖Δ_u‖ from the group norms (a one-group unit: the group's norm, exactly)."""
        return {u: (norms[m[0]] if len(m) == 1 else combine_norms([norms[h] for h in m]))
                for u, m in self._members.items()}

    # ---- clipping ---------------------------------------------------------------------
    def clip(self, update: Mapping[str, torch.Tensor]) -> ClipResult:
        """Clip one client's update (dict group → tensor); ‖result‖₂ ≤ C for every input."""
        return self.clip_many([update])[0]

    def clip_many(self, updates: Sequence[Mapping[str, torch.Tensor]]) -> list[ClipResult]:
        """Clip a block's clients (each exactly as :meth:`clip` would, bit for bit): every
        norm of every client is read back from the device in ONE transfer."""
        for update in updates:
            missing = [h for h in self._names if h not in update]
            extra = [h for h in update if h not in self._index]
            if missing or extra:
                raise ValueError(f"update groups do not match the policy: missing {missing[:3]}, "
                                 f"unexpected {extra[:3]}")
        tops, norm_list = norm_parts([u[h] for u in updates for h in self._names])
        g = len(self._names)
        return [self._clip_one(u, tops[i * g:(i + 1) * g], norm_list[i * g:(i + 1) * g])
                for i, u in enumerate(updates)]

    def _clip_one(self, update: Mapping[str, torch.Tensor], tops: Sequence[float],
                  norm_list: Sequence[float]) -> ClipResult:
        """One client's clip from its groups' (max |x|, norm) (:func:`norm_parts`)."""
        unit_thr = self.unit_thresholds()
        thr = {h: unit_thr[self._unit_of[h]] for h in self._names}
        pool_thr = self.pool_thresholds()
        if not all(math.isfinite(top) for top in tops):
            return self._zero_result(update, thr)
        norms = dict(zip(self._names, norm_list))
        unit_norms = self._unit_norms(norms)
        factors: dict[str, float] = {}
        clipped: dict[str, bool] = {}
        pool_norms, pool_clipped, pool_retained = {}, {}, {}
        for pool, rule in zip(self._pools, self._rules):
            pn = combine_norms([norms[h] for h in pool.groups])
            if rule.flat:
                hit = pn > pool_thr[pool.name]
                f = pool_thr[pool.name] / pn * (1.0 - MARGIN) if hit else 1.0
                for h in pool.groups:
                    factors[h], clipped[h] = f, hit
            else:  # one norm, one threshold, one factor per unit, shared by its groups
                for u in pool.units:
                    hit = unit_norms[u] > unit_thr[u]
                    f = unit_thr[u] / unit_norms[u] * (1.0 - MARGIN) if hit else 1.0
                    for h in self._members[u]:
                        factors[h], clipped[h] = f, hit
            # ‖clipped slice‖ from the factors; written as min() so an inf norm gives 0 not NaN
            if rule.flat:
                kept = min(pn, pool_thr[pool.name] * (1.0 - MARGIN))
            else:
                kept = combine_norms([min(unit_norms[u], unit_thr[u] * (1.0 - MARGIN))
                                      if clipped[self._members[u][0]] else unit_norms[u]
                                      for u in pool.units])
            pool_norms[pool.name] = pn
            pool_clipped[pool.name] = any(clipped[h] for h in pool.groups)
            pool_retained[pool.name] = (kept / pn if math.isfinite(pn) else 0.0) if pn > 0 else 1.0
        out = {}
        for h in self._names:
            t = update[h]
            dtype = torch.promote_types(t.dtype, torch.float32)
            if factors[h] == 1.0:
                out[h] = t.detach().to(dtype).clone()
            else:  # scale in float64, then cast: never rounds above the threshold (MARGIN)
                out[h] = (t.detach().to(torch.float64) * factors[h]).to(dtype)
        return ClipResult(out, norms, clipped, thr, pool_norms, pool_clipped, pool_retained,
                          combine_norms(list(norms.values())), False)

    def _zero_result(self, update: Mapping[str, torch.Tensor],
                     thr: dict[str, float]) -> ClipResult:
        nan = float("nan")
        out = {h: torch.zeros_like(update[h], dtype=torch.promote_types(update[h].dtype,
                                                                       torch.float32))
               for h in self._names}
        return ClipResult(out, {h: nan for h in self._names}, {h: True for h in self._names},
                          thr, {p.name: nan for p in self._pools},
                          {p.name: True for p in self._pools},
                          {p.name: 0.0 for p in self._pools}, nan, True)

    # ---- adaptive statistics ----------------------------------------------------------
    @property
    def statistic_size(self) -> int:
        """Length of one client's statistic vector: one entry per unit (0 for static policies)."""
        return len(self._unit_names) if self.adaptive else 0

    @property
    def statistic_sensitivity(self) -> float:
        """L2 bound Δ_s on one client's statistic (0 static; inf for the non-private variant)."""
        if not self.adaptive:
            return 0.0
        if not self.adaptive_private:
            return math.inf
        return self.stat_clip if self.adaptive == "ema" else math.sqrt(len(self._unit_names)) / 2.0

    @property
    def statistic_noise_std(self) -> float:
        """Std of the Gaussian the aggregator adds ONCE to the SUM of statistics (z_s·Δ_s)."""
        if not self.adaptive or not self.adaptive_private:
            return 0.0
        return self.stat_noise_multiplier * self.statistic_sensitivity

    def statistic(self, result_or_update: ClipResult | Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One client's bounded statistic (float64, length ``statistic_size``)."""
        if not self.adaptive:
            return torch.zeros(0, dtype=torch.float64)
        res = (result_or_update if isinstance(result_or_update, ClipResult)
               else self.clip(result_or_update))
        if self.adaptive == "ema":
            bound = self.stat_clip - self._stat_margin if self.adaptive_private else None
            unit_norms = self._unit_norms(res.group_norms)
            vals = norm_statistic([unit_norms[u] for u in self._unit_names], bound)
        else:  # a unit's groups share one clip decision: read it from its first member
            flags = None if res.nonfinite else [not res.group_clipped[self._members[u][0]]
                                                for u in self._unit_names]
            vals = indicator_statistic(flags, len(self._unit_names))
        return torch.tensor(vals, dtype=torch.float64)

    def update(self, noised_statistic_sum: torch.Tensor | None, denominator: float) -> None:
        """Adapt once per round from the (noised) SUM of statistics over the cohort; the
        ``denominator`` is the public cohort size (n, or q·N under Poisson sampling)."""
        if not self.adaptive:
            return
        if not denominator > 0:
            raise ValueError(f"denominator must be > 0, got {denominator}")
        v = torch.as_tensor(noised_statistic_sum, dtype=torch.float64).flatten().tolist()
        if len(v) != len(self._unit_names) or not all(math.isfinite(x) for x in v):
            raise ValueError("statistic sum must be finite with one entry per clipping unit")
        mean = [x / float(denominator) for x in v]
        if self.adaptive == "quantile":
            mean = [m + 0.5 for m in mean]  # un-centre: fraction of clients not clipped
        for pool, rule in zip(self._pools, self._rules):
            if rule.adaptive:
                rule.observe([mean[self._unit_index[u]] for u in pool.units])
        self.rounds_updated += 1

    # ---- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bitwise (plain floats; exact through torch.save/JSON)."""
        state = {"method": self.method, "groups": list(self._names),
                 "rounds_updated": self.rounds_updated,
                 "rules": [r.state_dict() if hasattr(r, "state_dict") else None
                           for r in self._rules]}
        if self._unit_names != self._names:  # layer grouping; matrix states stay as they were
            state["units"] = list(self._unit_names)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (same method, groups and clipping units)."""
        if state["method"] != self.method or list(state["groups"]) != self._names or \
                list(state.get("units", state["groups"])) != self._unit_names:
            raise ValueError("policy state is for a different method, group layout or grouping")
        for r, s in zip(self._rules, state["rules"]):
            if s is not None:
                r.load_state_dict(s)
        self.rounds_updated = int(state["rounds_updated"])


# ---- builders and registry --------------------------------------------------------------
PolicyBuilder = Callable[[PrivacyConfig, Sequence[GroupSpec]], ClipPolicy]
POLICIES: dict[str, PolicyBuilder] = {}


def register_policy(name: str) -> Callable[[PolicyBuilder], PolicyBuilder]:
    """Decorator adding a builder to :data:`POLICIES`."""
    def deco(fn: PolicyBuilder) -> PolicyBuilder:
        POLICIES[name] = fn
        return fn
    return deco


def build_pooled(method: str, cfg: PrivacyConfig, groups: Sequence[GroupSpec],
                 partition: Sequence[tuple[str, Callable[[GroupSpec], bool], float]],
                 rule: str) -> ClipPolicy:
    """A policy from ``(pool name, membership test, share)``; empty pools are dropped and the
    remaining shares renormalised (recorded in ``notes``). Membership is by group; a clipping
    unit (``privacy.grouping``) never straddles pools, since it lies in one component."""
    if not groups:
        raise ConfigError("model", "no trainable groups to clip")
    units = clipping_units(groups, cfg.grouping)
    notes, members = [], []
    if cfg.grouping != "matrix":
        notes.append(f"privacy.grouping={cfg.grouping}: {len(units)} clipping units over "
                     f"{len(groups)} groups; each group reports its unit's threshold")
    for name, test, share in partition:
        mine = [g for g in groups if test(g)]
        if mine:
            members.append((name, mine, share))
        else:
            notes.append(f"pool {name!r} has no groups; its share {share:g} goes to the others")
    total = math.fsum(s for _, _, s in members)
    pools = []
    for name, mine, share in members:
        names = {g.name for g in mine}
        pool_units = [u for u in units if u.members[0] in names]  # ClipPolicy checks the rest
        spec = PoolSpec(name, tuple(g.name for g in mine), share / total, rule,
                        tuple(u.name for u in pool_units))
        pools.append((spec, make_rule(rule, pool_units, cfg)))
    # keep pool member order = policy group order
    return ClipPolicy(method, groups, pools, cfg.clip_norm, units=units,
                      adaptive_private=cfg.adaptive_private, stat_clip=cfg.stat_clip,
                      stat_noise_multiplier=cfg.stat_noise_multiplier, notes=notes)


def _single_pool(method: str, rule: str) -> PolicyBuilder:
    def build(cfg: PrivacyConfig, groups: Sequence[GroupSpec]) -> ClipPolicy:
        return build_pooled(method, cfg, groups, [("all", lambda g: True, 1.0)], rule)
    return build


for _m in ("flat", "uniform", "size", "uniform-ema", "size-ema", "quantile", "probe"):
    register_policy(_m)(_single_pool(_m, _m))


@register_policy("alpha-split")
def build_alpha_split(cfg: PrivacyConfig, groups: Sequence[GroupSpec]) -> ClipPolicy:
    """Encoder pool αC², decoder pool (connector + decoder + anything else) (1−α)C²."""
    return build_pooled("alpha-split", cfg, groups, [
        ("encoder", lambda g: g.component == "encoder", cfg.alpha),
        ("decoder", lambda g: g.component != "encoder", 1.0 - cfg.alpha)], cfg.inside_pool)


@register_policy("pools")
def build_pools(cfg: PrivacyConfig, groups: Sequence[GroupSpec]) -> ClipPolicy:
    """K pools from ``privacy.pools``; every group's component must be in exactly one pool."""
    spec = cfg.pools or ()
    owner: dict[str, str] = {}
    for p in spec:
        for c in p["components"]:
            if c in owner:
                raise ConfigError("privacy.pools", f"component {c!r} is in pools "
                                  f"{owner[c]!r} and {p['name']!r}")
            owner[c] = p["name"]
    for g in groups:
        if g.component not in owner:
            raise ConfigError("privacy.pools", f"component {g.component!r} (group {g.name!r}) "
                              f"is in no pool; pools cover {sorted(owner)}")
    partition = [(str(p["name"]), (lambda g, cs=tuple(p["components"]): g.component in cs),
                  float(p["share"])) for p in spec]
    return build_pooled("pools", cfg, groups, partition, cfg.inside_pool)


def make_policy(privacy_cfg: PrivacyConfig, groups: Sequence[GroupSpec]) -> ClipPolicy:
    """The clipping policy named by ``privacy.clipping`` over ``groups``."""
    try:
        builder = POLICIES[privacy_cfg.clipping]
    except KeyError:
        raise ConfigError("privacy.clipping", f"got {privacy_cfg.clipping!r}; allowed: "
                          f"{', '.join(POLICIES)}") from None
    return builder(privacy_cfg, groups)
