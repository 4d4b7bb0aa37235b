"""Privacy accounting with dp-accounting (RDP or PLD) and the per-run ledger (``privacy.json``).

Mechanism per round: the cohort is sampled (Poisson with rate q, or fixed size m of N), every
sampled client's update is clipped to L2 ≤ C, the sum gets N(0, σ²C²) once. Adaptive policies
also release the sum of a per-client statistic (L2 ≤ Δ_s) with N(0, (z_s·Δ_s)²), on the SAME
cohort. Two Gaussian releases of the same sampled set are one Gaussian mechanism on the
concatenated vector (scale each part by its own sensitivity): σ_eff = (σ⁻² + z_s⁻²)^(-1/2)
(Mironov et al. 2019, §3; dp-accounting's RDP does the same for a ComposedDpEvent of Gaussians).

Neighbouring relation and sampling:
* Poisson: add/remove one client, ``PoissonSampledDpEvent(q, Gaussian(σ_eff))``; RDP or PLD.
* fixed size: replace one client (N public). Replacing one update moves the sum by up to 2C, so the
  Gaussian's multiplier relative to that sensitivity is σ_eff/2:
  ``SampledWithoutReplacementDpEvent(N, m, Gaussian(σ_eff/2))``. dp-accounting's PLD accountant
  has no sampling-without-replacement event, so with ``accountant: pld`` a fixed-size run falls
  back to RDP and the ledger says so (``accountant`` = "rdp", ``fallback`` = the reason).

Guarantee recorded (:data:`GUARANTEES`, shown wherever ε is: privacy.json, ``account``, tables):
* "valid": secure mode -- noise and cohorts from a CSPRNG, no seed recorded anywhere;
* "simulation": research mode -- ε is the mechanism's, but the run folder's config holds the
  seed from which the noise (and the cohorts) can be regenerated, so the folder itself is no
  protected release;
* "void": a channel is released without noise (exact diagnostics, recorded audit channels,
  non-private adaptive statistics, σ = 0), with ``void_reasons``;
* "none": ``privacy.mechanism: none``.
A void or "none" run's ε is +inf (``null`` in JSON), never the nominal figure of the update
channel alone.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import dp_accounting
from dp_accounting import pld, rdp

from cluster_fl.config import PrivacyConfig
from cluster_fl.errors import UserError
from cluster_fl.privacy.diagnostics import release_multiplier

ADAPTIVE_METHODS = ("uniform-ema", "size-ema", "quantile")
GUARANTEES = {
    "valid": "secure mode: noise and cohorts from a CSPRNG, no seed recorded",
    "simulation": "research mode: the mechanism's epsilon, but the run folder's seed "
                  "regenerates the noise and the cohorts",
    "void": "a channel is released without noise",
    "none": "no privacy mechanism",
}
# weakest first: a table cell of several runs shows the weakest guarantee among them
GUARANTEE_ORDER = ("none", "void", "simulation", "valid")
# the final evaluation releases per-utterance transcripts and errors exactly (eval.parquet)
EVAL_ON_CLIENTS = ("the evaluation set shares speakers with the clients (data.eval_split): "
                   "eval.parquet releases their utterances' transcripts and errors exactly")
# what ε is a bound for, said beside it: the two samplings' ε are not comparable
RELATIONS = {
    "poisson": "add/remove one client (Poisson cohorts); N is treated as public",
    "fixed": "replace one client (fixed-size cohorts of a public N)",
}
# the secure sampler's truncation: each Box-Muller pair's radius is at most
# sqrt(2*53*ln 2) = 8.57, i.e. the pair misses tail mass 2^-53 = 1.1e-16; a noised coordinate sums
# 4 normals (2 pairs), so at most 2.3e-16 of the accounted Gaussian's mass is cut per noised
# coordinate and round. Not added to δ (docs/privacy.md states the bound; the sampler's float
# grid is the floating-point question noise.py's sum of four addresses, not this one)
NOISE_TAIL = ("secure-mode noise: each coordinate sums 4 Box-Muller normals cut at 8.57 sigma "
              "(the accounted Gaussian's tails lose at most 2.3e-16 of mass per noised coordinate "
              "and round, not added to delta; see docs/privacy.md)")
PLD_FALLBACK = ("dp-accounting's PLD accountant does not support sampling without replacement; "
                "fixed-size cohorts are accounted with RDP")


def is_adaptive(privacy: PrivacyConfig) -> bool:
    """Whether the configured clipping releases an adaptive statistic each round."""
    return privacy.clipping in ADAPTIVE_METHODS or (
        privacy.clipping in ("alpha-split", "pools") and privacy.inside_pool == "ema")


def combined_noise_multiplier(sigma: float, statistic_sigma: float | None) -> float:
    """σ_eff = (σ⁻² + σ_s⁻²)^(-1/2): the update and statistic releases as one Gaussian."""
    if statistic_sigma is None:
        return float(sigma)
    if sigma <= 0 or statistic_sigma <= 0:
        return 0.0
    return (sigma ** -2 + statistic_sigma ** -2) ** -0.5


@dataclass(frozen=True)
class RoundEvent:
    """``count`` identical rounds of the mechanism (run-length encoded in the ledger)."""

    noise_multiplier: float
    statistic_noise_multiplier: float | None
    statistic_private: bool
    sampling: str
    sampling_rate: float
    population: int | None
    cohort_size: int | None
    count: int = 1

    def key(self) -> tuple[float, float | None, bool, str, float, int | None, int | None]:
        """Every field but ``count``: two events of one key are the same mechanism."""
        return (self.noise_multiplier, self.statistic_noise_multiplier, self.statistic_private,
                self.sampling, self.sampling_rate, self.population, self.cohort_size)

    def dp_event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event of ``count`` rounds."""
        if not self.statistic_private:
            return dp_accounting.NonPrivateDpEvent()
        sigma = combined_noise_multiplier(self.noise_multiplier, self.statistic_noise_multiplier)
        if sigma <= 0:
            return dp_accounting.NonPrivateDpEvent()
        if self.sampling == "fixed":
            if not self.population or not self.cohort_size:
                raise ValueError("fixed-size sampling needs population and cohort_size")
            inner = dp_accounting.SampledWithoutReplacementDpEvent(
                self.population, self.cohort_size, dp_accounting.GaussianDpEvent(sigma / 2.0))
        else:
            inner = dp_accounting.PoissonSampledDpEvent(
                self.sampling_rate, dp_accounting.GaussianDpEvent(sigma))
        return dp_accounting.SelfComposedDpEvent(inner, self.count)

    def describe(self) -> dict[str, Any]:
        """JSON form (for ``events`` in ``account --json`` and ``privacy.json``)."""
        d = asdict(self)
        d["rounds"] = d.pop("count")
        d["effective_noise_multiplier"] = combined_noise_multiplier(
            self.noise_multiplier, self.statistic_noise_multiplier)
        d["dp_event"] = repr(self.dp_event())
        return d


def _accountant(name: str, fixed: bool) -> tuple[Any, str]:
    relation = dp_accounting.NeighboringRelation
    if name == "pld" and not fixed:
        return pld.PLDAccountant(), "pld"
    if name not in ("rdp", "pld"):
        raise ValueError(f"unknown accountant {name!r}")
    rel = relation.REPLACE_ONE if fixed else relation.ADD_OR_REMOVE_ONE
    return rdp.RdpAccountant(neighboring_relation=rel), "rdp"


def epsilon_of_events(events: Sequence[RoundEvent], delta: float,
                      accountant: str = "rdp") -> tuple[float, str]:
    """(ε, accountant actually used) for a sequence of round events at ``delta``."""
    if not events:
        return 0.0, accountant
    fixed = {e.sampling == "fixed" for e in events}
    if len(fixed) > 1:
        raise ValueError("a run mixes Poisson and fixed-size rounds")
    acc, used = _accountant(accountant, fixed.pop())
    # dp-accounting logs (via absl) each RDP order it drops for not converging -- while composing
    # (where the RDP curve is computed), not only in get_epsilon; dropping an order can only make
    # ε larger (conservative), so these warnings are noise on stderr (~100 per `account`)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        for e in events:
            acc.compose(e.dp_event())
        eps = float(acc.get_epsilon(delta))
    finally:
        absl.setLevel(level)
    return (eps if math.isfinite(eps) else math.inf), used


def compute_epsilon(noise_multiplier: float, sampling_rate: float, rounds: int, delta: float, *,
                    accountant: str = "rdp", sampling: str = "poisson",
                    population: int | None = None, cohort_size: int | None = None,
                    statistic_noise_multiplier: float | None = None) -> float:
    """ε after ``rounds`` rounds of the (optionally statistic-composed) sampled Gaussian."""
    ev = RoundEvent(noise_multiplier, statistic_noise_multiplier, True, sampling,
                    sampling_rate, population, cohort_size, rounds)
    return epsilon_of_events([ev], delta, accountant)[0]


def noise_multiplier_for_epsilon(target_epsilon: float, sampling_rate: float, rounds: int,
                                 delta: float, *, rel_tol: float = 1e-5,
                                 **kwargs: Any) -> float:
    """Smallest σ (to ``rel_tol``) whose ε ≤ ``target_epsilon``: bisection on log σ.
    ``kwargs`` as :func:`compute_epsilon`. Raises UserError if the target is unreachable."""
    def eps(s: float) -> float:
        return compute_epsilon(s, sampling_rate, rounds, delta, **kwargs)
    lo, hi = 1e-3, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 4.0
        if hi > 1e6:
            raise UserError(f"target epsilon {target_epsilon:g} is unreachable at delta "
                            f"{delta:g} (the adaptive statistic alone may cost more; raise "
                            "privacy.stat_noise_multiplier)")
    while hi / lo > 1.0 + rel_tol:
        mid = math.sqrt(lo * hi)
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def side_noise_multiplier(cfg: Any) -> float | None:
    """The releases besides the update a round of ``cfg`` makes on its cohort -- the adaptive
    statistic and the noised diagnostics -- folded into one multiplier (None: none)."""
    p = cfg.privacy
    side = p.stat_noise_multiplier if is_adaptive(p) and p.adaptive_private else None
    z_d = release_multiplier(p)
    if z_d is not None:
        side = z_d if side is None else (side ** -2 + z_d ** -2) ** -0.5
    return side


def resolve_noise_multiplier(cfg: Any, population: int) -> Any:
    """``cfg`` with σ derived from ``privacy.target_epsilon`` when σ is unset: the smallest σ
    whose ε after ``fl.rounds`` rounds (update, adaptive statistic and diagnostics composed, as
    the run's ledger charges them) stays within the target. With both set, a σ whose ε passes
    the target is a :class:`UserError`. Without a target (or a mechanism), ``cfg`` unchanged."""
    import dataclasses

    p = cfg.privacy
    if p.mechanism != "gaussian" or p.target_epsilon is None:
        return cfg
    if is_adaptive(p) and not p.adaptive_private:
        raise UserError("privacy.target_epsilon cannot be met: non-private adaptive statistics "
                        "void the guarantee (set privacy.adaptive_private=true)")
    m = cfg.fl.clients_per_round
    if population < 1 or m > population:
        raise UserError(f"fl.clients_per_round ({m}) must be between 1 and the number of "
                        f"clients ({population}); set privacy.population or fl.clients_per_round")
    kwargs = dict(accountant=p.accountant, sampling=cfg.fl.sampling, population=population,
                  cohort_size=m, statistic_noise_multiplier=side_noise_multiplier(cfg))
    if p.noise_multiplier is None:
        sigma = noise_multiplier_for_epsilon(p.target_epsilon, m / population, cfg.fl.rounds,
                                             p.delta, **kwargs)
        return dataclasses.replace(cfg, privacy=dataclasses.replace(p, noise_multiplier=sigma))
    eps = compute_epsilon(p.noise_multiplier, m / population, cfg.fl.rounds, p.delta, **kwargs)
    if eps > p.target_epsilon * (1 + 1e-9):
        raise UserError(f"privacy.noise_multiplier {p.noise_multiplier:g} reaches epsilon "
                        f"{eps:.4g} after {cfg.fl.rounds} rounds, past privacy.target_epsilon "
                        f"{p.target_epsilon:g}: leave privacy.noise_multiplier unset to derive "
                        "it from the target, or raise the target")
    return cfg


def effective_noise_multipliers(policy: Any, sigma: float) -> tuple[dict[str, float],
                                                                    dict[str, float]]:
    """Per-pool and per-group effective noise multipliers σ·C/C_k (= σ/√α_k for a pool), with the
    nominal thresholds (before the fixed-point reserve, which shrinks C and every C_k alike)."""
    c = policy.clip_norm * getattr(policy, "threshold_scale", 1.0)
    pools = {k: (sigma * c / ck if ck > 0 else math.inf)
             for k, ck in policy.pool_thresholds().items()}
    groups = {h: (sigma * c / ch if ch > 0 else math.inf)
              for h, ch in policy.thresholds().items()}
    return pools, groups


class PrivacyLedger:
    """The run's privacy record: stepped once per round, serialised to ``privacy.json``."""

    def __init__(self, privacy: PrivacyConfig, *, sampling_rate: float,
                 sampling: str = "poisson", population: int | None = None,
                 cohort_size: int | None = None,
                 diagnostics_noise_multiplier: float | None = None) -> None:
        if privacy.noise_multiplier is None:
            raise ValueError("privacy.noise_multiplier is unresolved: derive it from "
                             "privacy.target_epsilon first (resolve_noise_multiplier)")
        self.privacy = privacy
        self.sigma: float = privacy.noise_multiplier
        self.sampling_rate = float(sampling_rate)
        self.sampling = sampling
        self.population = population
        self.cohort_size = cohort_size
        self.events: list[RoundEvent] = []
        self.pools: list[dict[str, Any]] = []
        self.void_reasons: list[str] = []
        # σ_d of a further Gaussian release per round on the same cohort (the round engine's
        # noised diagnostics); folded with the adaptive statistic into one event
        self.diagnostics_noise_multiplier = diagnostics_noise_multiplier
        self._cache: dict[tuple, float] = {}
        if privacy.mechanism == "gaussian" and privacy.noise_multiplier == 0:
            self.add_void_reason("privacy.noise_multiplier is 0: the update is released without noise")

    def add_void_reason(self, reason: str) -> None:
        """Record a channel released without noise (the engine's exact diagnostics, ...): the
        guarantee becomes "void" and ε +inf."""
        if reason not in self.void_reasons:
            self.void_reasons.append(reason)

    @property
    def rounds(self) -> int:
        return sum(e.count for e in self.events)

    @property
    def guarantee(self) -> str:
        """"none" (no mechanism), "void" (a channel released without noise), "simulation"
        (research mode: the recorded seed regenerates the noise) or "valid" (secure mode)."""
        if self.privacy.mechanism == "none":
            return "none"
        if self.void_reasons:
            return "void"
        return "valid" if self.privacy.secure_mode else "simulation"

    def record_policy(self, policy: Any) -> None:
        """Record pools (share, threshold, effective σ) and whether statistics are private."""
        sig_pool, _ = effective_noise_multipliers(policy, self.sigma)
        thr = policy.pool_thresholds()
        self.pools = [{"name": p.name, "share": p.share, "threshold": thr[p.name],
                       "effective_noise_multiplier": sig_pool[p.name], "rule": p.rule}
                      for p in policy.pools]
        if policy.adaptive and not policy.adaptive_private:
            self.add_void_reason(f"clipping {policy.method!r} adapts from exact, un-noised client "
                       "statistics (privacy.adaptive_private=false)")

    def step(self, policy: Any = None, rounds: int = 1) -> None:
        """Account ``rounds`` more rounds; the statistic stream comes from ``policy`` (or from
        the config when ``policy`` is None)."""
        p = self.privacy
        if policy is not None:
            self.record_policy(policy)
            adaptive, private = bool(policy.adaptive), policy.adaptive_private
            z_s = (policy.statistic_noise_std / policy.statistic_sensitivity
                   if adaptive and private else None)
        else:
            adaptive, private = is_adaptive(p), p.adaptive_private
            z_s = p.stat_noise_multiplier if adaptive and private else None
            if adaptive and not private:
                self.add_void_reason(f"clipping {p.clipping!r} adapts from exact, un-noised client "
                           "statistics (privacy.adaptive_private=false)")
        z_d = self.diagnostics_noise_multiplier
        if z_d is not None:  # one more Gaussian on the same cohort: σ_eff⁻² adds up
            z_s = z_d if z_s is None else (z_s ** -2 + z_d ** -2) ** -0.5
        ev = RoundEvent(self.sigma, z_s, not adaptive or private, self.sampling,
                        self.sampling_rate, self.population, self.cohort_size, rounds)
        if self.events and self.events[-1].key() == ev.key():
            last = self.events.pop()
            ev = RoundEvent(*last.key(), count=last.count + rounds)
        self.events.append(ev)

    def accountant_used(self) -> str:
        return "rdp" if self.sampling == "fixed" else self.privacy.accountant

    def epsilon(self) -> float:
        """ε at ``privacy.delta`` so far (the mechanism's, also for a simulation); +inf when the
        guarantee is void or none."""
        if self.guarantee in ("void", "none"):
            return math.inf
        # the engine asks every round; PLD / without-replacement RDP take ~0.1-1 s, so memoise
        key = tuple((e.key(), e.count) for e in self.events)
        if key not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            self._cache[key] = epsilon_of_events(self.events, self.privacy.delta,
                                                 self.privacy.accountant)[0]
        return self._cache[key]

    def to_json(self) -> dict[str, Any]:
        """The ``privacy.json`` record (ε null when infinite)."""
        eps = self.epsilon()
        fallback = (PLD_FALLBACK if self.privacy.accountant == "pld" and self.sampling == "fixed"
                    else None)
        return {
            "accountant": self.accountant_used(), "accountant_requested": self.privacy.accountant,
            "fallback": fallback, "epsilon": eps if math.isfinite(eps) else None,
            "delta": self.privacy.delta, "noise_multiplier": self.privacy.noise_multiplier,
            "sampling": self.sampling, "sampling_rate": self.sampling_rate,
            "population": self.population, "rounds": self.rounds,
            "events": [e.describe() for e in self.events] if self.guarantee != "none" else [],
            "pools": self.pools, "guarantee": self.guarantee,
            "guarantee_note": GUARANTEES[self.guarantee],
            "void_reasons": list(self.void_reasons), "mechanism": self.privacy.mechanism,
            "clipping": self.privacy.clipping, "clip_norm": self.privacy.clip_norm,
            "diagnostics": self.privacy.diagnostics,
            "diagnostics_noise_multiplier": self.diagnostics_noise_multiplier,
            "secure_mode": self.privacy.secure_mode,
            "neighbouring_relation": RELATIONS.get(self.sampling, self.sampling),
            "noise_tail": NOISE_TAIL if self.privacy.secure_mode else None,
        }

    def write(self, path: str | Path) -> None:
        """Write ``privacy.json`` atomically (temp file + rename)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)

    def state_dict(self) -> dict[str, Any]:
        """Resume state: the run-length-encoded events, pools and void reasons."""
        return {"events": [asdict(e) for e in self.events], "pools": list(self.pools),
                "void_reasons": list(self.void_reasons)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.events = [RoundEvent(**e) for e in state["events"]]
        self.pools = [dict(p) for p in state["pools"]]
        self.void_reasons = list(state["void_reasons"])


def ledger_for(cfg: Any, population: int) -> PrivacyLedger:
    """The ledger a run of ``cfg`` records: q = fl.clients_per_round / population, fl.sampling,
    the diagnostics release composed (:mod:`cluster_fl.privacy.diagnostics`; nothing when
    ``privacy.diagnostics: off``), exact diagnostics recorded as void."""
    m = cfg.fl.clients_per_round
    if population < 1 or m > population:
        raise UserError(f"fl.clients_per_round ({m}) must be between 1 and the number of "
                        f"clients ({population}); set privacy.population or fl.clients_per_round")
    ledger = PrivacyLedger(cfg.privacy, sampling_rate=m / population, sampling=cfg.fl.sampling,
                           population=population, cohort_size=m,
                           diagnostics_noise_multiplier=release_multiplier(cfg.privacy))
    if cfg.privacy.mechanism == "gaussian" and cfg.privacy.delta >= 1.0 / population:
        # δ ≥ 1/N admits a mechanism that releases one client's data whole with probability δ
        ledger.add_void_reason(f"privacy.delta {cfg.privacy.delta:g} is not below 1/N = "
                               f"1/{population}: an (epsilon, delta) guarantee with delta >= 1/N "
                               "allows releasing a client's data outright")
    if cfg.privacy.mechanism == "gaussian" and cfg.data.eval_split == cfg.data.client_split:
        ledger.add_void_reason(EVAL_ON_CLIENTS)
    if cfg.privacy.mechanism == "gaussian" and cfg.privacy.diagnostics == "exact":
        ledger.add_void_reason("privacy.diagnostics=exact: exact per-client diagnostics (norms, "
                               "clip flags, losses) are released without noise")
    return ledger
