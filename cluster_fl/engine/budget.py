"""The budget a run keeps: σ from ``privacy.target_epsilon``, ``privacy.max_epsilon``
checked before each round, and what a user must hear before a run starts.

ε depends on the config and the rounds charged only -- never on clients' data -- so every rank
takes these decisions alike, and the decisions themselves release nothing.
"""

from __future__ import annotations

from typing import Any

from cluster_fl.config import Config
from cluster_fl.errors import UserError


def resolve_sigma(cfg: Config) -> Config:
    """σ from ``privacy.target_epsilon`` when σ is unset; a σ that passes the target refused
    (:func:`~cluster_fl.privacy.accounting.resolve_noise_multiplier`), N counted as the run
    partitions the corpus."""
    p = cfg.privacy
    if p.mechanism != "gaussian" or p.target_epsilon is None:
        return cfg
    from cluster_fl.data import count_clients
    from cluster_fl.privacy.accounting import resolve_noise_multiplier

    try:
        population = int(count_clients(cfg.data))
    except OSError as exc:
        raise UserError(f"data.corpus: cannot count the clients of {cfg.data.corpus} to derive "
                        f"sigma from privacy.target_epsilon ({type(exc).__name__})") from None
    return resolve_noise_multiplier(cfg, population)


def over_budget(ledger: Any, r: int, cfg: Config) -> str | None:
    """Why the run stops before round ``r`` (``privacy.max_epsilon``: ε once ``ledger``, the
    run's :class:`~cluster_fl.engine.ledger.RunLedger`, charges ``r``), or None."""
    limit = cfg.privacy.max_epsilon
    if limit is None:
        return None
    eps = ledger.epsilon_if_charged(r)
    if eps <= limit:
        return None
    return (f"stopped before round {r}: its charge would take epsilon to {eps:.4g}, past "
            f"privacy.max_epsilon {limit:g}")


def start_notes(cfg: Config, ledger: Any) -> list[str]:
    """What a user must hear before a run starts: σ = 0, a void guarantee (and why, from the
    privacy core's ``ledger``), a model from random init, σ derived from the target, a budget
    the run keeps."""
    p = cfg.privacy
    notes = []
    if p.mechanism == "gaussian":
        if p.target_epsilon is not None:
            notes.append(f"privacy: sigma {p.noise_multiplier:.6g} for target epsilon "
                         f"{p.target_epsilon:g} over {cfg.fl.rounds} rounds at delta {p.delta:g}")
        if p.noise_multiplier == 0:
            notes.append("warning: privacy.noise_multiplier is 0: the update is released "
                         "without noise")
        notes += [f"warning: guarantee void: {reason}" for reason in ledger.void_reasons]
        if p.max_epsilon is not None:
            notes.append(f"privacy: the run stops before a round that would take epsilon past "
                         f"privacy.max_epsilon {p.max_epsilon:g}")
    if cfg.model.checkpoint is None:
        from cluster_fl.models import get_arch

        if get_arch(cfg.model.arch).tiny:
            notes.append(f"warning: model.checkpoint is not set: {cfg.model.arch} starts from "
                         "random init")
    return notes
