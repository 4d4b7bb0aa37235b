"""The run's privacy ledger: the privacy core's ledger, charged once per round AHEAD of the round.

The privacy core (``privacy.accounting.ledger_for``) accounts the update, the adaptive statistic
and the noised per-round diagnostics as one Gaussian per round and records exact diagnostics or
non-private statistics as void -- so ``cluster-fl account`` reports the ε a run records. The
engine adds what only it knows: recorded audit channels write per-client uploads in the clear.

Write-ahead. :meth:`RunLedger.charge` accounts round r and writes ``privacy.json`` durably
(fsync of the file and of its folder) BEFORE round r's noise is drawn; the record names the run
and the highest round whose noise may have been drawn (``rounds_started``). A crash can then waste
budget, never leak it: a resume charges from the record, which is never behind the checkpoint
(:meth:`RunLedger.resume` checks), so the ledger holds max(checkpointed, started) rounds.
A round that is run again after a crash is charged again in secure mode (fresh noise from a
CSPRNG: a second release of that round); in research mode it is not (the noise is a function of
(seed, round, run), and the round reproduces its release bit for bit -- what a simulation
promises).
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any

from cluster_fl.engine.rundir import write_json
from cluster_fl.errors import UserError

LEDGER_NAME = "privacy.json"


class RunLedger:
    """Charges the privacy core's ledger once per round with the run's clipping policy, and
    keeps its write-ahead record (``privacy.json``) once :meth:`attach`-ed to a run folder."""

    def __init__(self, ledger: Any, policy: Any, record_channels: bool = False):
        self.ledger = ledger
        self.policy = policy
        self.secure = bool(getattr(ledger.privacy, "secure_mode", False))
        self.started = 0  # the highest round whose noise may have been drawn, in any attempt
        self.path: Path | None = None
        self.run_id: str | None = None
        self.nonce: str | None = None  # the run's (config.yaml's): a copied ledger is refused
        self.dataset: Any = None  # the dataset's cumulative ledger (engine/dataset_ledger.py)
        self.epoch: str | None = None  # this ledger's epoch there: new whenever it starts empty
        self.dataset_epsilon: float | None = None
        self.main = False
        if policy is not None and record_channels:
            ledger.add_void_reason("audit.record_channels=true: per-client uploads, norms and "
                                   "sample counts are written to channels/ in the clear")

    # ---- the write-ahead record ------------------------------------------------------------
    def attach(self, folder: Path, main: bool, nonce: str | None = None,
               dataset: Any = None) -> None:
        """Keep the record in ``folder/privacy.json``; only ``main`` (rank 0) writes it.
        ``nonce``: the run's, which the record carries and a resume checks; ``dataset``: the
        dataset's cumulative ledger, which every write adds this ledger's rounds to."""
        self.path = Path(folder) / LEDGER_NAME
        self.run_id = Path(folder).name
        self.nonce = nonce
        self.dataset = dataset
        self.epoch = secrets.token_hex(8)  # a ledger that starts empty: a new epoch
        self.main = main

    def resume(self, checkpoint: dict[str, Any] | None) -> None:
        """Take over what earlier attempts charged: the record in ``privacy.json``, checked
        against the (verified) checkpoint. A record that is missing while a checkpoint exists,
        unreadable, of another run, or behind the checkpoint is a one-line error: the budget
        this run has spent could not be known."""
        path = self.path
        if path is None:
            raise RuntimeError("attach the ledger to its run folder first")
        fix = (f"restore it, or delete {path.parent / 'checkpoint'} and {path} to restart the "
               "run from round 1" + (f" (what it spent stays in {self.dataset.path})"
                                     if self.dataset is not None else ""))
        if not path.is_file():
            if checkpoint is not None:
                raise UserError(f"{path} is missing but the run has a checkpoint: the privacy "
                                f"budget it has spent cannot be verified; {fix}")
            return
        try:
            record = json.loads(path.read_text())
            started = int(record["rounds_started"])
            state = record["state"]
            charged = sum(int(e["count"]) for e in state["events"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{path} is unreadable or not a write-ahead ledger "
                            f"({type(exc).__name__}); {fix}") from None
        if record.get("run_id") != self.run_id:
            raise UserError(f"{path} belongs to run {record.get('run_id')!r}, not "
                            f"{self.run_id!r}; {fix}")
        if record.get("run_nonce") != self.nonce:
            raise UserError(f"{path} belongs to another run (nonce {record.get('run_nonce')!r}, "
                            f"the folder's config.yaml says {self.nonce!r}: copied from another "
                            f"run folder?); {fix}")
        if checkpoint is not None:
            behind = sum(int(e["count"]) for e in checkpoint["ledger"]["events"])
            if started < int(checkpoint["round"]) or charged < behind:
                raise UserError(f"{path} records {started} round(s) started and {charged} "
                                f"charged, behind the checkpoint of round "
                                f"{checkpoint['round']} ({behind} charged); {fix}")
        self.ledger.load_state_dict(state)
        self.started = started
        self.epoch = str(record.get("epoch") or self.epoch)

    def charge(self, round_: int) -> None:
        """Account round ``round_`` before its noise is drawn, durably (rank 0 writes the
        record). A round already started in an earlier attempt is charged again only in secure
        mode (module docstring)."""
        if self.secure or round_ > self.started:
            self.ledger.step(self.policy)
        self.started = max(self.started, round_)
        self.write()

    def epsilon_if_charged(self, round_: int) -> float:
        """ε once round ``round_`` is charged (as :meth:`charge` would), the ledger unchanged:
        what ``privacy.max_epsilon`` is checked against before the round starts."""
        if not (self.secure or round_ > self.started):
            return self.ledger.epsilon()
        saved = self.ledger.state_dict()
        try:
            self.ledger.step(self.policy)
            return self.ledger.epsilon()
        finally:
            self.ledger.load_state_dict(saved)

    def write(self) -> None:
        """The record, written atomically and durably (rank 0 only), after the dataset's
        cumulative ledger has this ledger's rounds."""
        if self.main and self.path is not None:
            if self.dataset is not None and self.epoch is not None:
                self.dataset_epsilon = self.dataset.record(self.epoch, self.ledger.state_dict())
            write_json(self.path, self.to_json(), durable=True)

    # ---- reading ----------------------------------------------------------------------------
    @property
    def rounds(self) -> int:
        """Rounds charged so far (T of the accountant)."""
        return self.ledger.rounds

    def step_round(self) -> None:
        """Account one more round without a record (callers outside a run folder)."""
        self.ledger.step(self.policy)

    def epsilon(self) -> float:
        return self.ledger.epsilon()

    def pool_sigmas(self) -> list[dict]:
        return list(self.ledger.pools)

    def to_json(self) -> dict[str, Any]:
        """``privacy.json``: the privacy core's record, the run it belongs to, the rounds
        started and the state a resume continues from."""
        record = self.ledger.to_json()
        eps = record.get("epsilon")
        record["epsilon"] = eps if eps is None or math.isfinite(eps) else None
        # the same keys in every record (null without a dataset ledger: a non-private run)
        record.update(epoch=self.epoch if self.dataset is not None else None,
                      dataset_ledger=self.dataset.path.name if self.dataset is not None else None,
                      dataset_epsilon=self.dataset_epsilon)
        record.update(run_id=self.run_id, run_nonce=self.nonce, rounds_started=self.started,
                      state=self.ledger.state_dict())
        return record

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger.load_state_dict(state)
