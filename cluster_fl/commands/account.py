"""``cluster-fl account CONFIG [key=value ..] [--json]``: the ε of a config, model-free.

ε after ``fl.rounds`` rounds at ``privacy.delta`` with q = fl.clients_per_round / N; N is
``privacy.population`` or, when that is 0, the number of clients in the corpus
(``cluster_fl.data.count_clients``), which is what a training run accounts with. With
``privacy.target_epsilon`` it also reports the σ that reaches it. The ledger is the one a run
records (``privacy.accounting.ledger_for``): the update, the adaptive statistic and the noised
diagnostics composed, with the guarantee a run of the config records: ``valid`` (secure mode),
``simulation`` (research mode: the mechanism's ε, but the run folder's seed regenerates the
noise), ``void`` or ``none``. JSON (DESIGN §10): {"accountant", "epsilon", "delta", "noise_multiplier",
"sampling_rate", "rounds", "events": [...]} plus extra keys.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from cluster_fl.commands import add_report_arguments, print_report
from cluster_fl.config import Config
from cluster_fl.errors import UserError
from cluster_fl.privacy.accounting import (is_adaptive, ledger_for, noise_multiplier_for_epsilon,
                                           resolve_noise_multiplier, side_noise_multiplier)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG, overrides, --json."""
    add_report_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return print_report(args, account_report, format_account)


def population_of(cfg: Config) -> int:
    """N for accounting: ``privacy.population`` or the corpus' client count."""
    from cluster_fl.data import count_clients

    if cfg.privacy.population > 0:
        return cfg.privacy.population
    hint = "set privacy.population=N (the number of clients) to account without the corpus"
    try:
        n = int(count_clients(cfg.data))
    except (OSError, UserError) as exc:
        raise UserError(f"cannot count clients in {cfg.data.corpus!r} "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                        f"{hint}") from None
    if n < 1:
        raise UserError(f"the corpus {cfg.data.corpus!r} has no clients; {hint}")
    return n


def account_report(cfg: Config) -> dict[str, Any]:
    """The ``account --json`` object for ``cfg``."""
    population = population_of(cfg)
    derived = cfg.privacy.noise_multiplier is None  # from the target, as train derives it
    if derived:
        cfg = resolve_noise_multiplier(cfg, population)
    p = cfg.privacy
    ledger = ledger_for(cfg, population)
    ledger.step(rounds=cfg.fl.rounds)
    record = ledger.to_json()
    out = {k: record[k] for k in ("accountant", "epsilon", "delta", "noise_multiplier",
                                  "sampling_rate", "rounds", "events")}
    out.update({"accountant_requested": p.accountant, "fallback": record["fallback"],
                "guarantee": record["guarantee"], "guarantee_note": record["guarantee_note"],
                "void_reasons": record["void_reasons"],
                "sampling": cfg.fl.sampling, "population": population,
                "clients_per_round": cfg.fl.clients_per_round, "mechanism": p.mechanism,
                "clipping": p.clipping, "adaptive_statistic": is_adaptive(p),
                "statistic_noise_multiplier": (p.stat_noise_multiplier
                                               if is_adaptive(p) and p.adaptive_private
                                               else None),
                "diagnostics_noise_multiplier": ledger.diagnostics_noise_multiplier,
                "target_epsilon": p.target_epsilon, "noise_multiplier_for_target": None,
                "noise_multiplier_derived": derived,
                "neighbouring_relation": record["neighbouring_relation"],
                "noise_tail": record["noise_tail"]})
    side = side_noise_multiplier(cfg)  # every release besides the update, folded
    if p.target_epsilon is not None and record["guarantee"] != "none":
        if is_adaptive(p) and not p.adaptive_private:
            raise UserError("privacy.target_epsilon cannot be met: non-private adaptive "
                            "statistics void the guarantee (set privacy.adaptive_private=true)")
        try:
            out["noise_multiplier_for_target"] = noise_multiplier_for_epsilon(
                p.target_epsilon, ledger.sampling_rate, cfg.fl.rounds, p.delta,
                accountant=p.accountant, sampling=cfg.fl.sampling, population=population,
                cohort_size=cfg.fl.clients_per_round,
                statistic_noise_multiplier=side)
        except UserError as exc:  # still report ε; say why no σ reaches the target
            out["target_note"] = str(exc)
    return out


def _num(x: Any) -> str:
    if x is None:
        return "n/a"
    return "inf" if isinstance(x, float) and math.isinf(x) else f"{x:.6g}"


def format_account(r: dict[str, Any]) -> str:
    lines = [f"accountant     {r['accountant']}" + (f" ({r['fallback']})" if r["fallback"] else ""),
             f"sampling       {r['sampling']}, q = {r['sampling_rate']:.6g} "
             f"({r['clients_per_round']} of {r['population']} clients)",
             f"rounds         {r['rounds']}",
             f"noise σ        {_num(r['noise_multiplier'])}"
             + (" (derived from privacy.target_epsilon)" if r.get("noise_multiplier_derived")
                else ""),
             f"delta          {r['delta']:g}",
             f"epsilon        {_num(r['epsilon'])}   [guarantee: {r['guarantee']}]",
             f"neighbouring   {r['neighbouring_relation']}",
             f"guarantee      {r['guarantee']}: {r['guarantee_note']}"]
    if r["statistic_noise_multiplier"] is not None:
        eff = r["events"][0]["effective_noise_multiplier"] if r["events"] else None
        lines.append(f"adaptive stat  z_s = {_num(r['statistic_noise_multiplier'])} composed "
                     f"(effective σ {_num(eff)})")
    lines += [f"void           {v}" for v in r["void_reasons"]]
    if r["noise_multiplier_for_target"] is not None:
        lines.append(f"σ for ε = {r['target_epsilon']:g}: {r['noise_multiplier_for_target']:.6g}")
    if r.get("target_note"):
        lines.append(f"σ for ε = {r['target_epsilon']:g}: none ({r['target_note']})")
    return "\n".join(lines)
