"""The privacy sections of the run configuration: ``privacy`` (clipping policy, Gaussian noise,
accounting, the budget), ``aggregation`` (the secure sum and the server step) and ``audit``.
Split from :mod:`cluster_fl.config.schema` (which re-exports them) to keep each module short;
the rules are the schema's: frozen, keyword-only, every key validated where it is declared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from cluster_fl.config.checks import ConfigError
from cluster_fl.config.checks import check as _check
from cluster_fl.config.checks import in_range as _range
from cluster_fl.config.checks import one_of as _in

CLIPPING_METHODS = (
    "flat",
    "uniform",
    "size",
    "uniform-ema",
    "size-ema",
    "quantile",
    "probe",
    "alpha-split",
    "pools",
)
INSIDE_POOL_RULES = ("size", "uniform", "flat", "ema")
GROUPINGS = ("matrix", "layer")
COMPONENTS = ("encoder", "connector", "decoder")


@dataclass(frozen=True, kw_only=True)
class PrivacyConfig:
    """Central DP: clipping policy, Gaussian noise, accounting. Sensitivity is ``clip_norm``."""

    mechanism: str = "gaussian"
    """``gaussian`` (DP-FedAvg) or ``none`` (non-private FedAvg; must be written out)."""
    clipping: str = "alpha-split"
    """Clipping policy: one of ``CLIPPING_METHODS``."""
    clip_norm: float = 1.0
    """Total L2 clipping budget C (joint sensitivity of one client's update)."""
    noise_multiplier: float | None = None
    """Noise multiplier σ: the summed update gets N(0, σ²C²). Unset: derived by ``train`` (and
    ``account``) from ``target_epsilon`` over ``fl.rounds`` when that is set, else 0.1. Set
    together with ``target_epsilon``, a run refuses a σ whose ε over ``fl.rounds`` passes the
    target. 0 releases the update without noise (guarantee ``void``, said at start)."""
    alpha: float = 0.05
    """Encoder pool share of C² for ``alpha-split``."""
    inside_pool: str = "size"
    """Rule inside each pool for ``alpha-split``/``pools``: size, uniform, flat, ema."""
    pools: tuple[Mapping[str, Any], ...] | None = None
    """For ``pools``: ``[{name, components: [...], share}, ...]`` with shares summing to 1."""
    grouping: str = "matrix"
    """What one per-layer threshold covers: ``matrix`` (each LoRA A / B matrix and connector
    weight / bias) or ``layer`` (all matrices of one transformer layer of one component, the
    connector as one layer: the paper's per-layer clipping). Flat clipping and pool membership
    do not depend on it; see ``cluster_fl.groups.clipping_units``."""
    delta: float = 1e-5
    """Target δ."""
    accountant: str = "rdp"
    """``rdp`` or ``pld`` (dp-accounting)."""
    target_epsilon: float | None = None
    """ε the run is to reach after ``fl.rounds`` rounds at ``delta``: with ``noise_multiplier``
    unset, ``train`` and ``account`` derive the smallest σ that stays within it; with both set,
    ``train`` refuses a σ that passes it and ``account`` reports the σ that reaches it."""
    max_epsilon: float | None = None
    """A budget ``train`` keeps: the run stops cleanly (status ``done``, the reason in
    status.json, the final evaluation run) before the round whose charge would take ε past it;
    a resume stops there too. Null = no budget."""
    secure_mode: bool = False
    """Noise and masks from the OS CSPRNG, floating-point-attack-resistant noise; no seed: a
    seed given in a preset or an override is refused (``run.seed`` resolves to null), and the
    run draws its cohort and client randomness from the OS at every start."""
    adaptive_private: bool = True
    """Adaptive statistics (EMA, quantile) are clipped, noised and accounted. ``False`` reproduces
    the paper's non-private EMA and records the guarantee as void."""
    ema_decay: float = 0.9
    """EMA decay of the per-group mean client norm."""
    ema_gamma: float = 1.0
    """Exponent γ on the EMA norm in the EMA weights."""
    ema_warmup_rounds: int = 3
    """Rounds with base weights before EMA weights take over."""
    stat_clip: float = 1.0
    """L2 bound on one client's vector of adaptive statistics (per-group norms)."""
    stat_noise_multiplier: float = 1.0
    """Noise multiplier on the summed adaptive statistics (composed in the accountant)."""
    quantile_target: float = 0.5
    """Target unclipped fraction γ for quantile clipping (Andrew et al. 2021)."""
    quantile_lr: float = 0.2
    """Geometric learning rate η for quantile clipping."""
    probe_norms: str | None = None
    """JSON of per-group mean norms from a public probe (``calibrate``) for ``probe`` clipping."""
    population: int = 0
    """Number of clients N for ``cluster-fl account`` without a corpus (q = fl.clients_per_round
    / N); 0 = count the corpus' clients. Training ignores it: a run accounts with the clients it
    partitioned from the corpus."""
    diagnostics: str = "noised"
    """Per-round diagnostics computed from clients' updates (clip flags, retained ratios, pool
    norms, loss): ``noised`` -- each client's diagnostic vector is bounded to [0, 1] per entry,
    summed securely, noised once and composed in the accountant; ``exact`` -- exact values
    (and per-group norms) for research figures, and the run's guarantee is recorded as void;
    ``off`` -- none are released (the run releases only the update) and the accountant charges
    nothing for them. ``on`` is ``noised``."""
    diagnostics_noise_multiplier: float = 5.0
    """Noise multiplier on the summed diagnostic vectors (sensitivity = sqrt(entries)). It is
    composed with the update each round: at 5, ε grows ~4% at σ = 1 and ~1% at σ = 0.5; at 1
    it would cost as much as the update itself at σ = 1."""

    def __post_init__(self) -> None:
        _in(self.mechanism, ("gaussian", "none"), "privacy.mechanism")
        _check(isinstance(self.secure_mode, bool), "privacy.secure_mode",
               f"got {self.secure_mode!r}; must be true or false")
        _in(self.clipping, CLIPPING_METHODS, "privacy.clipping")
        _range(self.clip_norm, "privacy.clip_norm", 0.0, None, lo_open=True)
        if self.noise_multiplier is None and (self.target_epsilon is None
                                              or self.mechanism == "none"):
            object.__setattr__(self, "noise_multiplier", 0.1)  # the default without a target
        if self.noise_multiplier is not None:
            _range(self.noise_multiplier, "privacy.noise_multiplier", 0.0, None)
        _range(self.alpha, "privacy.alpha", 0.0, 1.0, lo_open=True, hi_open=True)
        _in(self.inside_pool, INSIDE_POOL_RULES, "privacy.inside_pool")
        _in(self.grouping, GROUPINGS, "privacy.grouping")
        _range(self.delta, "privacy.delta", 0.0, 1.0, lo_open=True, hi_open=True)
        _in(self.accountant, ("rdp", "pld"), "privacy.accountant")
        if self.target_epsilon is not None:
            _range(self.target_epsilon, "privacy.target_epsilon", 0.0, None, lo_open=True)
        if self.max_epsilon is not None:
            _range(self.max_epsilon, "privacy.max_epsilon", 0.0, None, lo_open=True)
        _range(self.ema_decay, "privacy.ema_decay", 0.0, 1.0, hi_open=True)
        _range(self.ema_gamma, "privacy.ema_gamma", 0.0, 10.0)
        _range(self.ema_warmup_rounds, "privacy.ema_warmup_rounds", 0, None, integer=True)
        _range(self.stat_clip, "privacy.stat_clip", 0.0, None, lo_open=True)
        _range(self.stat_noise_multiplier, "privacy.stat_noise_multiplier", 0.0, None,
               lo_open=True)
        _range(self.quantile_target, "privacy.quantile_target", 0.0, 1.0, lo_open=True,
               hi_open=True)
        _range(self.quantile_lr, "privacy.quantile_lr", 0.0, 10.0, lo_open=True)
        _range(self.population, "privacy.population", 0, None, integer=True)
        if isinstance(self.diagnostics, bool):  # YAML 1.1 reads on/off as booleans: on = noised
            object.__setattr__(self, "diagnostics", "noised" if self.diagnostics else "off")
        _in(self.diagnostics, ("noised", "exact", "off"), "privacy.diagnostics")
        _range(self.diagnostics_noise_multiplier, "privacy.diagnostics_noise_multiplier", 0.0,
               None, lo_open=True)
        if self.clipping == "pools":
            _check(self.pools is not None and len(self.pools) >= 1, "privacy.pools",
                   "clipping 'pools' needs a list of {name, components, share}")
        if self.pools is not None:
            object.__setattr__(self, "pools", tuple(dict(p) for p in self.pools))
            total = 0.0
            for i, p in enumerate(self.pools):
                key = f"privacy.pools[{i}]"
                _check(set(p) >= {"name", "components", "share"}, key,
                       "each pool needs name, components and share")
                _range(p["share"], key + ".share", 0.0, 1.0, lo_open=True)
                total += p["share"]
            _check(abs(total - 1.0) < 1e-9, "privacy.pools",
                   f"shares must sum to 1 (got {total!r})")

    @property
    def sigma(self) -> float:
        """σ, resolved: unset only while ``target_epsilon`` is to derive it (``train`` and
        ``account`` do, with the run's N); asking before that is an error naming the key."""
        if self.noise_multiplier is None:
            raise ConfigError("privacy.noise_multiplier", "unset: it is derived from "
                              "privacy.target_epsilon when a run starts; set it to use it here")
        return self.noise_multiplier


@dataclass(frozen=True, kw_only=True)
class AggregationConfig:
    """Server side: secure sum and the server step."""

    server_optimizer: str = "fedavg"
    """``fedavg`` (θ += noised mean update × server_lr), ``momentum`` or ``adam``."""
    server_lr: float = 1.0
    """Server learning rate on the noised mean update."""
    server_momentum: float = 0.9
    """Momentum for ``momentum`` (β1 for ``adam``)."""
    secure_sum: bool = True
    """Pairwise-masked fixed-point int64 all-reduce (exact, order-independent)."""
    fixed_point_bits: int = 32
    """Fractional bits of the fixed-point encoding."""
    weighting: str = "uniform"
    """``uniform`` (every clipped update counts 1) or ``samples`` (weight min(n_i, cap)/cap ≤ 1,
    so a prolific speaker cannot exceed the sensitivity)."""
    weight_cap: int = 64
    """Sample cap for ``samples`` weighting."""

    def __post_init__(self) -> None:
        _in(self.server_optimizer, ("fedavg", "momentum", "adam"),
            "aggregation.server_optimizer")
        _range(self.server_lr, "aggregation.server_lr", 0.0, 100.0, lo_open=True)
        _range(self.server_momentum, "aggregation.server_momentum", 0.0, 1.0, hi_open=True)
        _range(self.fixed_point_bits, "aggregation.fixed_point_bits", 8, 48, integer=True)
        _in(self.weighting, ("uniform", "samples"), "aggregation.weighting")
        _range(self.weight_cap, "aggregation.weight_cap", 1, None, integer=True)


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """Privacy-audit gates, fixed before the run."""

    margin_pp: float = 1.0
    """Fail when the bound on (attack accuracy − constant baseline) exceeds this, in points."""
    family_alpha: float = 0.05
    """Family-wise error rate, Bonferroni-split over the whole battery."""
    canaries: int = 64
    """Canary trials for the empirical ε lower bound."""
    record_channels: bool = False
    """Record per-client uploads, per-rank partial sums and releases for the audit."""

    def __post_init__(self) -> None:
        _range(self.margin_pp, "audit.margin_pp", 0.0, 100.0)
        _range(self.family_alpha, "audit.family_alpha", 0.0, 1.0, lo_open=True, hi_open=True)
        _range(self.canaries, "audit.canaries", 0, None, integer=True)
