"""The run's privacy ledger: the privacy core's accountant plus the engine's own releases.

Besides the clipped update (σ) and an adaptive policy's statistic (σ_s), a round releases the
summed diagnostic vectors. With ``privacy.diagnostics: noised`` that release is a Gaussian
mechanism with noise multiplier σ_d on the same sampled cohort, so the round is accounted as one
Gaussian with σ_eff = (σ⁻² + σ_s⁻² + σ_d⁻²)^(-1/2) (the vector-Gaussian identity used by Andrew
et al. 2021). With ``exact`` diagnostics the guarantee is recorded as void.
"""

from __future__ import annotations

import math
from typing import Any


class _AsLedgerSees:
    """The clipping policy with the diagnostics release folded into its statistic stream."""

    def __init__(self, policy: Any, diag_multiplier: float):
        self._policy = policy
        self._diag = diag_multiplier

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    @property
    def adaptive(self) -> bool:
        return True

    @property
    def adaptive_private(self) -> bool:
        return bool(getattr(self._policy, "adaptive_private", True)) or not self._policy.adaptive

    @property
    def statistic_sensitivity(self) -> float:
        return 1.0

    @property
    def statistic_noise_std(self) -> float:
        inv = self._diag ** -2
        if self._policy.adaptive and self._policy.adaptive_private:
            inv += (self._policy.statistic_noise_std / self._policy.statistic_sensitivity) ** -2
        return inv ** -0.5


class RunLedger:
    """Steps the privacy core's ledger once per round, including the diagnostics release."""

    def __init__(self, ledger: Any, policy: Any, diag: Any, record_channels: bool = False):
        self.ledger = ledger
        self.policy = policy
        self.diag = diag
        self.private = policy is not None
        if self.private and record_channels:
            ledger.add_void_reason("audit.record_channels=true: per-client uploads, norms and "
                                   "sample counts are written to channels/ in the clear")
        if self.private and diag.exact:
            ledger.add_void_reason("privacy.diagnostics=exact: exact per-client diagnostics (norms, clip "
                         "flags, losses) are released without noise")
        self._seen = policy
        if self.private and not diag.exact:
            self._seen = _AsLedgerSees(policy, diag.noise_std / diag.sensitivity)

    def step_round(self) -> None:
        self.ledger.step(self._seen if self.private else None)

    def epsilon(self) -> float:
        return self.ledger.epsilon()

    def pool_sigmas(self) -> list[dict]:
        return list(self.ledger.pools)

    def to_json(self) -> dict[str, Any]:
        out = self.ledger.to_json()
        out["diagnostics"] = {
            "mode": "exact" if self.diag.exact else "noised",
            "entries": self.diag.size,
            "noise_multiplier": (self.diag.noise_std / self.diag.sensitivity
                                 if self.diag.noise_std else None),
            "note": ("folded into each round's statistic_noise_multiplier"
                     if self.private and not self.diag.exact else
                     "released exactly" if self.private else "non-private run"),
        }
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state)


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
