"""``cluster-fl account`` and ``cluster-fl thresholds``: privacy figures of a config, model-free.

``account CONFIG [key=value ..] [--json]``: ε after ``fl.rounds`` rounds at ``privacy.delta`` with
q = fl.clients_per_round / N; N is ``privacy.population`` or, when that is 0, the number of
clients in the corpus (``cluster_fl.data.count_clients``). With ``privacy.target_epsilon`` it also
reports the σ that reaches it. JSON (DESIGN §10): {"accountant", "epsilon", "delta",
"noise_multiplier", "sampling_rate", "rounds", "events": [...]} plus extra keys.

``thresholds CONFIG [key=value ..] [--json]``: per-group thresholds and per-pool effective noise
multipliers of the configured clipping policy, on ``model.layout`` when given, else on the model's
groups (``cluster_fl.models.describe_groups``). Adaptive policies show their round-1 thresholds.
JSON: {"total_budget", "groups": [{"name", "component", "numel", "pool", "threshold"}],
"pools": [{"name", "share", "effective_noise_multiplier"}]} plus extra keys.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from cluster_fl.config import Config, load_config
from cluster_fl.errors import UserError
from cluster_fl.groups import GroupSpec, groups_from_layout
from cluster_fl.privacy.accounting import (is_adaptive, ledger_for, noise_multiplier_for_epsilon,
                                           effective_noise_multipliers)
from cluster_fl.privacy.clipping import make_policy


def add_arguments_for(command: str, parser: argparse.ArgumentParser) -> None:
    """Arguments of ``account`` / ``thresholds``: CONFIG, overrides, --json."""
    from cluster_fl.cli import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the JSON contract")


def run_for(command: str, args: argparse.Namespace) -> int:
    """Run ``account`` or ``thresholds``."""
    cfg = load_config(args.config, args.overrides)
    report = account_report(cfg) if command == "account" else thresholds_report(cfg)
    if args.json:
        print(json.dumps(report, indent=2, default=_json_default, allow_nan=False))
    else:
        print(_format_account(report) if command == "account" else _format_thresholds(report))
    return 0


def _json_default(x: Any) -> Any:
    return str(x)


def population_of(cfg: Config) -> int:
    """N for accounting: ``privacy.population`` or the corpus' client count."""
    if cfg.privacy.population > 0:
        return cfg.privacy.population
    hint = "set privacy.population=N (the number of clients) to account without the corpus"
    try:
        from cluster_fl.data import count_clients  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        raise UserError(f"cannot count the corpus' clients (cluster_fl.data.count_clients is "
                        f"unavailable); {hint}") from None
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
    p = cfg.privacy
    population = population_of(cfg)
    ledger = ledger_for(cfg, population)
    ledger.step(rounds=cfg.fl.rounds)
    record = ledger.to_json()
    out = {k: record[k] for k in ("accountant", "epsilon", "delta", "noise_multiplier",
                                  "sampling_rate", "rounds", "events")}
    out.update({"accountant_requested": p.accountant, "fallback": record["fallback"],
                "guarantee": record["guarantee"], "void_reasons": record["void_reasons"],
                "sampling": cfg.fl.sampling, "population": population,
                "clients_per_round": cfg.fl.clients_per_round, "mechanism": p.mechanism,
                "clipping": p.clipping, "adaptive_statistic": is_adaptive(p),
                "statistic_noise_multiplier": (p.stat_noise_multiplier
                                               if is_adaptive(p) and p.adaptive_private
                                               else None),
                "diagnostics_noise_multiplier": ledger.diagnostics_noise_multiplier,
                "target_epsilon": p.target_epsilon, "noise_multiplier_for_target": None})
    side = out["statistic_noise_multiplier"]  # every release besides the update, folded
    z_d = ledger.diagnostics_noise_multiplier
    if z_d is not None:
        side = z_d if side is None else (side ** -2 + z_d ** -2) ** -0.5
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


def groups_of(cfg: Config) -> tuple[list[GroupSpec], list[str]]:
    """Trainable groups from ``model.layout`` or the model registry, and notes."""
    notes: list[str] = []
    if cfg.model.layout is not None:
        groups = groups_from_layout(cfg.model.layout)
        if cfg.model.freeze_encoder:
            groups = [g for g in groups if g.component != "encoder"]
            notes.append("model.freeze_encoder: encoder groups of model.layout are not trained")
        return groups, notes
    try:
        from cluster_fl.models import describe_groups  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        raise UserError("cannot describe the model's groups yet; give model.layout "
                        "([{name, component, numel}, ...]) in the config") from None
    return list(describe_groups(cfg.model)), notes


def thresholds_report(cfg: Config) -> dict[str, Any]:
    """The ``thresholds --json`` object for ``cfg``."""
    groups, notes = groups_of(cfg)
    policy = make_policy(cfg.privacy, groups)
    sigma = cfg.privacy.noise_multiplier
    sig_pool, sig_group = effective_noise_multipliers(policy, sigma)
    table = policy.group_table()
    for row in table:
        row["effective_noise_multiplier"] = sig_group[row["name"]]
    thr = policy.pool_thresholds()
    pools = [{"name": p.name, "share": p.share, "effective_noise_multiplier": sig_pool[p.name],
              "threshold": thr[p.name], "rule": p.rule, "groups": len(p.groups)}
             for p in policy.pools]
    return {"total_budget": policy.clip_norm, "groups": table, "pools": pools,
            "clipping": policy.method, "noise_multiplier": sigma,
            "mechanism": cfg.privacy.mechanism, "adaptive": policy.adaptive,
            "notes": notes + list(policy.notes)}


def _num(x: Any) -> str:
    if x is None:
        return "n/a"
    return "inf" if isinstance(x, float) and math.isinf(x) else f"{x:.6g}"


def _format_account(r: dict[str, Any]) -> str:
    lines = [f"accountant     {r['accountant']}" + (f" ({r['fallback']})" if r["fallback"] else ""),
             f"sampling       {r['sampling']}, q = {r['sampling_rate']:.6g} "
             f"({r['clients_per_round']} of {r['population']} clients)",
             f"rounds         {r['rounds']}",
             f"noise σ        {_num(r['noise_multiplier'])}",
             f"delta          {r['delta']:g}",
             f"epsilon        {_num(r['epsilon'])}   [guarantee: {r['guarantee']}]"]
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


def _format_thresholds(r: dict[str, Any]) -> str:
    lines = [f"clipping {r['clipping']}, C = {r['total_budget']:g}, σ = "
             f"{r['noise_multiplier']:g}" + (f", adaptive ({r['adaptive']}): round-1 thresholds"
                                              if r["adaptive"] else "")]
    lines.append(f"{'pool':<12} {'share':>10} {'threshold':>12} {'eff. σ':>10} groups")
    for p in r["pools"]:
        lines.append(f"{p['name']:<12} {p['share']:>10.4g} {p['threshold']:>12.6g} "
                     f"{p['effective_noise_multiplier']:>10.4f} {p['groups']}")
    lines.append("")
    w = max([len(g["name"]) for g in r["groups"]] + [5])
    lines.append(f"{'group':<{w}} {'component':<10} {'numel':>10} {'pool':<10} {'threshold':>12}")
    for g in r["groups"]:
        lines.append(f"{g['name']:<{w}} {g['component']:<10} {g['numel']:>10} {g['pool']:<10} "
                     f"{g['threshold']:>12.6g}")
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)
