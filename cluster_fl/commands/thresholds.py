"""``cluster-fl thresholds CONFIG [key=value ..] [--json]``: per-group thresholds and per-pool
effective noise multipliers of the configured clipping policy, model-free.

The groups come from ``model.layout`` when given, else from the model registry
(``cluster_fl.models.describe_groups``, sizes from the meta device: nothing is loaded). Adaptive
policies show their round-1 thresholds. JSON (DESIGN §10): {"total_budget", "groups": [{"name",
"component", "numel", "pool", "threshold"}], "pools": [{"name", "share",
"effective_noise_multiplier"}]} plus extra keys (a group's "unit" and a pool's "units": the
clipping units of ``privacy.grouping``; a group's threshold is its unit's).
"""

from __future__ import annotations

import argparse
from typing import Any

from cluster_fl.commands import add_report_arguments, print_report
from cluster_fl.config import Config
from cluster_fl.groups import GroupSpec, groups_from_layout
from cluster_fl.privacy.accounting import effective_noise_multipliers
from cluster_fl.privacy.clipping import make_policy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG, overrides, --json."""
    add_report_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return print_report(args, thresholds_report, format_thresholds)


def groups_of(cfg: Config) -> tuple[list[GroupSpec], list[str]]:
    """Trainable groups from ``model.layout`` or the model registry, and notes."""
    notes: list[str] = []
    if cfg.model.layout is not None:
        groups = groups_from_layout(cfg.model.layout)
        if cfg.model.freeze_encoder:
            groups = [g for g in groups if g.component != "encoder"]
            notes.append("model.freeze_encoder: encoder groups of model.layout are not trained")
        return groups, notes
    from cluster_fl.models import describe_groups

    return list(describe_groups(cfg.model)), notes


def thresholds_report(cfg: Config) -> dict[str, Any]:
    """The ``thresholds --json`` object for ``cfg``."""
    groups, notes = groups_of(cfg)
    policy = make_policy(cfg.privacy, groups)
    sigma = cfg.privacy.sigma
    sig_pool, sig_group = effective_noise_multipliers(policy, sigma)
    table = policy.group_table()
    for row in table:
        row["effective_noise_multiplier"] = sig_group[row["name"]]
    thr = policy.pool_thresholds()
    pools = [{"name": p.name, "share": p.share, "effective_noise_multiplier": sig_pool[p.name],
              "threshold": thr[p.name], "rule": p.rule, "groups": len(p.groups),
              "units": len(p.units)}
             for p in policy.pools]
    return {"total_budget": policy.clip_norm, "groups": table, "pools": pools,
            "clipping": policy.method, "noise_multiplier": sigma,
            "mechanism": cfg.privacy.mechanism, "adaptive": policy.adaptive,
            "notes": notes + list(policy.notes)}


def format_thresholds(r: dict[str, Any]) -> str:
    lines = [f"clipping {r['clipping']}, C = {r['total_budget']:g}, σ = "
             f"{r['noise_multiplier']:g}" + (f", adaptive ({r['adaptive']}): round-1 thresholds"
                                              if r["adaptive"] else "")]
    lines.append(f"{'pool':<12} {'share':>10} {'threshold':>12} {'eff. σ':>10} groups (units)")
    for p in r["pools"]:
        lines.append(f"{p['name']:<12} {p['share']:>10.4g} {p['threshold']:>12.6g} "
                     f"{p['effective_noise_multiplier']:>10.4f} {p['groups']} "
                     f"({p.get('units', p['groups'])})")
    lines.append("")
    w = max([len(g["name"]) for g in r["groups"]] + [5])
    lines.append(f"{'group':<{w}} {'component':<10} {'numel':>10} {'pool':<10} {'threshold':>12}")
    for g in r["groups"]:  # a group's threshold is its clipping unit's (privacy.grouping)
        unit = f"  unit {g['unit']}" if g.get("unit", g["name"]) != g["name"] else ""
        lines.append(f"{g['name']:<{w}} {g['component']:<10} {g['numel']:>10} {g['pool']:<10} "
                     f"{g['threshold']:>12.6g}{unit}")
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)
