"""The dataset's cumulative privacy ledger: what every run on the same clients has spent.

A run's ``privacy.json`` accounts that run. Deleting it with the checkpoint restarts the run
from round 1 -- and the rounds released before the reset were a release of the same clients all
the same (in secure mode with noise no seed regenerates). So every private run also records, in
``<run.out>/.privacy/<dataset>.json``, the rounds each of its ledger *epochs* charged; an epoch
begins whenever a run's ledger starts empty (its first start, or a start after ``privacy.json``
was deleted). A reset adds an epoch and forgets nothing.

The dataset is the corpus folder's name and the clients' split (``data.corpus``,
``data.client_split``): runs on other languages or fewer clients of it still draw from the same
speakers, so they are counted together (conservative). The cumulative ε composes the rounds of
every epoch (RDP at the reading run's δ; runs that mix Poisson and fixed-size cohorts, whose
neighbouring relations differ, have no one cumulative ε: None). Rank 0 updates the file under an
exclusive ``flock``, atomically and durably, before its round's noise, like ``privacy.json``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from cluster_fl.config import Config
from cluster_fl.engine.rundir import WriteError, write_json

DIR = ".privacy"


def dataset_key(cfg: Config) -> dict[str, str]:
    """What names a dataset: the corpus folder's name and the clients' split."""
    corpus = os.path.basename(os.path.normpath(os.path.expanduser(cfg.data.corpus)))
    return {"corpus": corpus, "client_split": cfg.data.client_split}


def dataset_path(cfg: Config) -> Path:
    """``<run.out>/.privacy/<corpus>-<split>-<hash>.json``."""
    key = dataset_key(cfg)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return (Path(cfg.run.out).expanduser() / DIR
            / f"{key['corpus'][:80]}-{key['client_split'][:40]}-{digest}.json")


class DatasetLedger:
    """Rank 0's writer of the dataset's cumulative ledger for one run (see module docstring)."""

    def __init__(self, cfg: Config, folder: Path):
        self.path = dataset_path(cfg)
        self.key = dataset_key(cfg)
        self.run = f"{cfg.run.experiment}/{Path(folder).name}"
        self.delta = cfg.privacy.delta

    def record(self, epoch: str, state: dict[str, Any]) -> float | None:
        """Record the rounds ``epoch`` of this run has charged (its ledger's ``state``) and
        return the cumulative ε of the dataset at this run's δ (None: no one ε)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise WriteError(lock, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            book = self.read()
            book.setdefault("dataset", self.key)
            book.setdefault("epochs", {})[epoch] = {"run": self.run, "state": state}
            eps = cumulative_epsilon(book, self.delta)
            book["epsilon"] = eps
            book["delta"] = self.delta
            write_json(self.path, book, durable=True)
            return eps
        finally:
            os.close(fd)  # drops the flock

    def read(self) -> dict[str, Any]:
        """The ledger as it is on disk ({} when there is none or it cannot be read: a damaged
        book is rewritten from the epochs the runs hold, never trusted for less)."""
        try:
            book = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return book if isinstance(book, dict) and isinstance(book.get("epochs"), dict) else {}


def cumulative_epsilon(book: dict[str, Any], delta: float) -> float | None:
    """ε of every epoch's rounds composed, at ``delta`` (None where no one ε exists)."""
    from cluster_fl.privacy.accounting import RoundEvent, epsilon_of_events

    try:
        events = [RoundEvent(**e) for epoch in book.get("epochs", {}).values()
                  for e in epoch["state"]["events"]]
        if any(epoch["state"].get("void_reasons") for epoch in book["epochs"].values()):
            return None  # a channel released without noise: no finite ε
        eps, _ = epsilon_of_events(events, delta, "rdp")
    except (ValueError, KeyError, TypeError):
        return None
    return eps if math.isfinite(eps) else None
