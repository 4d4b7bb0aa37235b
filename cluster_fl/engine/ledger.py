"""The run's privacy ledger: the privacy core's ledger, stepped once per round by the engine.

The privacy core (``privacy.accounting.ledger_for``) accounts the update, the adaptive statistic
and the noised per-round diagnostics as one Gaussian per round and records exact diagnostics or
non-private statistics as void -- so ``cluster-fl account`` reports the ε a run records. The
engine adds what only it knows: recorded audit channels write per-client uploads in the clear.
"""

from __future__ import annotations

from typing import Any


class RunLedger:
    """Steps the privacy core's ledger once per round with the run's clipping policy."""

    def __init__(self, ledger: Any, policy: Any, record_channels: bool = False):
        self.ledger = ledger
        self.policy = policy
        if policy is not None and record_channels:
            ledger.add_void_reason("audit.record_channels=true: per-client uploads, norms and "
                                   "sample counts are written to channels/ in the clear")

    def step_round(self) -> None:
        self.ledger.step(self.policy)

    def epsilon(self) -> float:
        return self.ledger.epsilon()

    def pool_sigmas(self) -> list[dict]:
        return list(self.ledger.pools)

    def to_json(self) -> dict[str, Any]:
        return self.ledger.to_json()

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state)
