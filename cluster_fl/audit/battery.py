"""The audit battery: every declared (channel, attack) cell, each with its controls and gate.

For each gated probe cell the same features go through three arms:
* the attack itself (true labels);
* the shuffled-label twin (labels permuted per sample) -- the negative control, must not fire;
* a planted leak at known doses on a null base (labels permuted, then a label-aligned direction of
  relative size ``dose`` added) -- the dose–response curve; its top dose is the positive control,
  which must fire or the cell is ``underpowered``.
The gate (``stats.gate``) is applied to the attack with m = every gated cell DECLARED in
``channels.BATTERY`` (fixed before the data are seen, whether or not the cell can run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from cluster_fl.audit import attacks
from cluster_fl.audit.canary import run_canaries
from cluster_fl.audit.channels import (BATTERY, CHANNELS, Recording, battery_size,
                                       load_recording, partial_labels)
from cluster_fl.audit.stats import gate
from cluster_fl.audit.sweep import alpha_sweep
from cluster_fl.config import Config, ConfigError, build_config, load_config
from cluster_fl.groups import GroupSpec
from cluster_fl.privacy.accounting import effective_noise_multipliers
from cluster_fl.privacy.clipping import make_policy

DOSES = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0)
NOISE_DOSES = (1.0, 0.5, 0.25, 0.1, 0.03, 0.0)
ZERO_DOSES = (0.0, 0.01, 0.05, 0.2)


class Settings:
    """Gate settings read from the run's config (fixed before the run)."""

    def __init__(self, cfg: Config, seed: int = 0):
        self.cfg = cfg
        self.m = battery_size()
        self.margin_pp = cfg.audit.margin_pp
        self.family_alpha = cfg.audit.family_alpha
        self.seed = seed

    def gate(self, outcome: attacks.AttackOutcome, **controls: Any) -> Any:
        """The pre-set gate on one outcome."""
        return gate(outcome.correct, outcome.n, outcome.baseline, m=self.m,
                    family_alpha=self.family_alpha, margin_pp=self.margin_pp, **controls)


def not_measured(reason: str) -> dict:
    """A declared cell that did not run, with why."""
    return {"status": "not measured", "reason": reason, "verdict": "not measured"}


def gated_probe(x: np.ndarray, labels: np.ndarray, groups: np.ndarray, grouping: str,
                s: Settings) -> dict:
    """Attack + shuffled twin + planted dose series, gated (see module docstring)."""
    real = attacks.probe(x, labels, groups, grouping, seed=s.seed)
    if real is None:
        return not_measured("fewer than two label values or CV groups")
    neg = s.gate(attacks.probe(x, attacks.shuffle_labels(labels, s.seed + 1), groups, grouping,
                               seed=s.seed))
    null_labels = attacks.shuffle_labels(labels, s.seed + 2)
    curve = []
    for d in DOSES:
        planted = attacks.plant_label_leak(x, null_labels, d, s.seed + 3)
        g = s.gate(attacks.probe(planted, null_labels, groups, grouping, seed=s.seed))
        curve.append({"dose": d, **_curve_point(g)})
    pos_fired = curve[-1]["fired"]
    res = s.gate(real, positive_fired=pos_fired, negative_clean=not neg.fired)
    return {"status": "measured", "grouping": real.grouping, "gate": res.to_dict(),
            "verdict": res.verdict, "negative_control": neg.to_dict(),
            "positive_control": {"dose": DOSES[-1], "fired": pos_fired},
            "dose_response": curve, "onset_dose": _onset(curve)}


def _curve_point(g: Any) -> dict:
    return {"excess_pp": g.excess_pp, "lower_cp_pp": g.lower_cp_pp, "upper_cp_pp": g.upper_cp_pp,
            "fired": g.fired}


def _onset(curve: list[dict]) -> float | None:
    fired = [c["dose"] for c in curve if c["fired"]]
    return min(fired) if fired else None


def linkability_cell(x: np.ndarray, clients: np.ndarray, rounds: np.ndarray, s: Settings) -> dict:
    """Cross-round linkability with a within-round id shuffle (negative) and planted ids (doses)."""
    real = attacks.linkability(x, clients, rounds)
    if real is None:
        return not_measured("no client observed in two consecutive recorded rounds")
    rng = np.random.default_rng(s.seed + 4)
    shuffled = clients.copy()
    for r in np.unique(rounds):
        idx = np.where(rounds == r)[0]
        shuffled[idx] = clients[rng.permutation(idx)]
    neg = s.gate(attacks.linkability(x, shuffled, rounds))
    curve = []
    for d in DOSES:
        planted = attacks.plant_label_leak(attacks.project(x), shuffled, d, s.seed + 5)
        g = s.gate(attacks.linkability(planted, shuffled, rounds))
        curve.append({"dose": d, **_curve_point(g)})
    res = s.gate(real, positive_fired=curve[-1]["fired"], negative_clean=not neg.fired)
    return {"status": "measured", "grouping": real.grouping, "gate": res.to_dict(),
            "verdict": res.verdict, "negative_control": neg.to_dict(),
            "positive_control": {"dose": DOSES[-1], "fired": curve[-1]["fired"]},
            "dose_response": curve, "onset_dose": _onset(curve)}


def zero_cell(tensors: dict[str, np.ndarray], s: Settings) -> dict:
    """Structural zero-support check with a planted-pattern dose series (no labels: no twin)."""
    if not tensors:
        return not_measured("no tensors recorded")
    found = attacks.zero_support(tensors)
    clean = {k: np.where(v == 0, 1e-30, v) for k, v in tensors.items()}  # no exact zeros left
    curve = []
    for d in ZERO_DOSES:
        planted = attacks.plant_zero_rows(clean, d, s.seed + 6)
        curve.append({"dose": d, "fired": attacks.zero_support(planted)["flagged"]})
    pos = any(c["fired"] for c in curve if c["dose"] > 0)
    neg_clean = not curve[0]["fired"]
    if found["flagged"]:
        verdict = "fail"
    else:
        verdict = "pass" if pos and neg_clean else "underpowered"
    return {"status": "measured", "structure": found, "verdict": verdict,
            "negative_control": {"dose": 0.0, "fired": curve[0]["fired"]},
            "positive_control": {"dose": ZERO_DOSES[1], "fired": curve[1]["fired"]},
            "dose_response": curve, "onset_dose": _onset(curve)}


def _components(rec: Recording) -> tuple[list[str], list[str]]:
    comp = rec.components()
    enc = [g for g in rec.uploads["clipped"] if comp.get(g) == "encoder"] if rec.uploads else []
    dec = [g for g in rec.uploads["clipped"] if comp.get(g) in ("connector", "decoder")] \
        if rec.uploads else []
    return enc, dec


def upload_cells(rec: Recording, s: Settings) -> dict[str, dict]:
    """uploads × {speaker, language probes per part, linkability, zero support}."""
    u = rec.uploads
    if u is None:
        why = "no uploads recorded (audit.record_channels was false)"
        return {a: not_measured(why) for c, a, _ in BATTERY if c == "uploads"}
    enc, dec = _components(rec)
    out = {}
    for part, names in (("encoder", enc), ("decoder", dec)):
        if not names:
            why = f"no {part} groups in the update (e.g. frozen {part})"
            out[f"speaker_probe/{part}"] = out[f"language_probe/{part}"] = not_measured(why)
            continue
        x = attacks.flatten_rows([u["clipped"][g] for g in names])
        grouping, groups = _speaker_grouping(u)
        out[f"speaker_probe/{part}"] = gated_probe(x, u["speakers"], np.asarray(groups),
                                                   grouping, s)
        out[f"language_probe/{part}"] = gated_probe(x, u["languages"], u["client_ids"],
                                                    "client", s)
    x_all = attacks.flatten_rows(list(u["clipped"].values()))
    out["linkability"] = linkability_cell(x_all, u["client_ids"], u["rounds"], s)
    out["zero_support"] = zero_cell(u["clipped"], s)
    return out


def _speaker_grouping(u: dict) -> tuple[str, list]:
    """By client when speakers span clients, else by round (see attacks module)."""
    return attacks.speaker_grouping(u["speakers"], u["client_ids"], u["rounds"])


def partial_cells(rec: Recording, s: Settings) -> dict[str, dict]:
    """partial sums × {language probe on the masked view, zero support}."""
    p = rec.partials
    if p is None:
        why = "no partial sums recorded"
        return {"language_probe/masked": not_measured(why), "zero_support": not_measured(why)}
    masked = p["masked"].astype(np.float64)
    labels = partial_labels(rec)
    out = {}
    if labels is None:
        out["language_probe/masked"] = not_measured("rank membership of clients not recorded")
    else:
        cell = gated_probe(masked, labels, p["rounds"], "round", s)
        if p["plain"] is not None and cell["status"] == "measured":
            plain = attacks.probe(p["plain"], labels, p["rounds"], "round", seed=s.seed)
            cell["mask_off_control"] = s.gate(plain).to_dict() if plain else None
        out["language_probe/masked"] = cell
    out["zero_support"] = zero_cell({"masked": p["masked"]}, s)
    return out


def measured_noise(rec: Recording, s: Settings) -> tuple[np.ndarray | None, str]:
    """Per-round noise the engine added: n·release − Σ w_i·clipped_i (needs every upload)."""
    r, u = rec.releases, rec.uploads
    names = list(r["noised_mean"])
    if u is None or any(g not in u["clipped"] for g in names):
        return None, "uploads missing: noise drawn from the recorded noise_std (engine untested)"
    agg = s.cfg.aggregation
    w = np.ones(len(u["rounds"]))
    if agg.weighting == "samples":
        w = np.minimum(u["n_samples"], agg.weight_cap) / agg.weight_cap
    rows = []
    for i, rnd in enumerate(r["rounds"]):
        sel = u["rounds"] == rnd
        if not sel.any():
            return None, f"no uploads for round {rnd}: noise drawn from the recorded noise_std"
        parts = []
        for g in names:
            total = np.tensordot(w[sel], u["clipped"][g][sel].astype(np.float64), axes=1)
            parts.append((r["noised_mean"][g][i] * r["denominator"][i] - total).ravel())
        rows.append(np.concatenate(parts))
    return np.stack(rows), "measured: n·release − Σ clipped uploads"


def release_cells(rec: Recording, s: Settings) -> tuple[dict[str, dict], dict | None]:
    """release × {canary ε, speaker probe (n/a), zero support}; also the canary dose series."""
    why_probe = ("the release is one aggregate per round: no per-client label to infer; "
                 "membership is measured by the canary test")
    if rec.releases is None:
        why = "no releases recorded"
        return ({"canary_epsilon": not_measured(why), "speaker_probe": not_measured(why_probe),
                 "zero_support": not_measured(why)}, None)
    p = s.cfg.privacy
    r = rec.releases
    names = list(r["noised_mean"])
    thr = canary_thresholds(rec.groups)
    sizes = [int(np.prod(r["noised_mean"][g].shape[1:])) for g in names]
    if p.mechanism == "none" or any(thr.get(g) is None for g in names):
        canary = not_measured("no DP mechanism or no per-group thresholds in groups.json")
        series = None
    else:
        noise, source = measured_noise(rec, s)
        if noise is None:
            std = float(np.nanmean(r["noise_std"])) if np.isfinite(r["noise_std"]).any() \
                else p.sigma * p.clip_norm
            noise = np.random.default_rng(s.seed).normal(0, std, (len(r["rounds"]), sum(sizes)))
        trials = max(s.cfg.audit.canaries, 2)
        kw = dict(thresholds=[thr[g] for g in names], sizes=sizes, trials=trials,
                  sigma=p.sigma, clip_norm=p.clip_norm, delta=p.delta,
                  alpha=s.family_alpha, accountant=p.accountant, noise_source=source,
                  seed=s.seed)
        res = run_canaries(noise, **kw)
        series = [{"noise_scale": k, "epsilon_lb": run_canaries(noise, noise_scale=k, **kw)
                   .bound.epsilon_lb} for k in NOISE_DOSES]
        canary = {"status": "measured", "verdict": res.verdict, "canary": res.to_dict(),
                  "positive_control": {"dose": "noise off",
                                       "fired": series[-1]["epsilon_lb"] > res.accounted_epsilon},
                  "dose_response": series}
    zeros = zero_cell(r["noised_mean"], s)
    return ({"canary_epsilon": canary, "speaker_probe": not_measured(why_probe),
             "zero_support": zeros}, canary if isinstance(canary, dict) else None)


def canary_thresholds(groups: list[dict]) -> dict[str, float | None]:
    """Per-group canary radii from ``groups.json`` whose joint norm is the policy's C.

    A group reports its clipping unit's threshold C_u (``privacy.grouping``); under ``layer``
    grouping several groups share one unit, so radii C_u·√(p_h/p_u) split C_u² over the unit's
    groups by size (Σ_{h∈u} radius_h² = C_u², the worst case the unit allows). Rows without a
    ``unit`` (older run folders) or with unit = name (``matrix``) keep their own threshold."""
    size: dict[str, int] = {}
    for g in groups:
        unit = g.get("unit", g["name"])
        size[unit] = size.get(unit, 0) + int(g["numel"])
    out: dict[str, float | None] = {}
    for g in groups:
        c, unit = g.get("threshold"), g.get("unit", g["name"])
        if c is None or size[unit] == int(g["numel"]):
            out[g["name"]] = c
        else:
            out[g["name"]] = float(c) * float(np.sqrt(int(g["numel"]) / size[unit]))
    return out


def side_cells(rec: Recording, s: Settings) -> dict[str, dict]:
    """side statistics × {speaker/language probes on raw norms + sample counts; n/a items}."""
    u = rec.uploads
    out: dict[str, dict] = {}
    if u is None or not u["raw_norms"]:
        why = "per-client raw norms / sample counts not recorded"
        out["speaker_probe/norms_counts"] = out["language_probe/norms_counts"] = not_measured(why)
    else:
        feats = [np.log1p(np.nan_to_num(v, nan=0.0)) for v in u["raw_norms"].values()]
        x = np.stack(feats + [np.log1p(u["n_samples"].astype(float))], axis=1)
        grouping, groups = _speaker_grouping(u)
        out["speaker_probe/norms_counts"] = gated_probe(x, u["speakers"], np.asarray(groups),
                                                        grouping, s)
        out["language_probe/norms_counts"] = gated_probe(x, u["languages"], u["client_ids"],
                                                         "client", s)
    out["adaptive_thresholds"] = not_measured(
        "per-round adaptive-clipping releases are cohort aggregates (noised when "
        "privacy.adaptive_private); no membership attack on them is implemented")
    out.update(record_cells(rec.run_dir))
    return out


def record_cells(run_dir: Path) -> dict[str, dict]:
    """The released record × {exact counts, timing} (:mod:`cluster_fl.audit.record`): a scan
    of every released file, with a planted positive control (a cohort-size column, a
    timestamped log line with a duration) that must fire and a clean record that must not."""
    import tempfile

    from cluster_fl.audit.record import RECORD_FILES, scan_record

    if not any((Path(run_dir) / name).exists() for name in RECORD_FILES):
        why = "no released record (rows, final row, log, status, ledger) in the folder"
        return {"exact_counts": not_measured(why), "timing": not_measured(why)}
    found = scan_record(run_dir)
    with tempfile.TemporaryDirectory() as empty:
        clean = scan_record(empty, rows=[{"round": 1, "denominator": 4.0, "loss": 0.71}],
                            log_lines=["round 1/1: eps 1.2 (diagnostics off)"])
        planted = scan_record(empty, rows=[{"round": 1, "denominator": 4.0, "n_cohort": 3,
                                            "wall_s": 1.5}],
                              log_lines=["[12:00:01] round 1/1: clients 3, eps 1.2, 1.5s"])
    out = {}
    for kind in ("exact_counts", "timing"):
        pos, neg = bool(planted[kind]), not clean[kind]
        verdict = "fail" if found[kind] else ("pass" if pos and neg else "underpowered")
        out[kind] = {"status": "measured", "verdict": verdict, "findings": found[kind],
                     "negative_control": {"dose": "clean record", "fired": not neg},
                     "positive_control": {"dose": "planted", "fired": pos,
                                          "findings": planted[kind]}}
    return out


def run_battery(run_dir: str | Path, seed: int = 0,
                sweep: Callable[[Recording, Settings], list] | None = None) -> dict:
    """Load a run folder and score every declared cell; returns the report dict."""
    run_dir = Path(run_dir)
    rec = load_recording(run_dir)
    cfg_path = run_dir / "config.yaml"
    notes = list(rec.notes)
    if cfg_path.is_file():
        cfg = load_config(cfg_path)
    else:
        cfg = build_config({})
        notes.append("config.yaml missing: default gates and privacy settings assumed")
    s = Settings(cfg, seed)
    cells = {"uploads": upload_cells(rec, s), "partial_sums": partial_cells(rec, s),
             "side_stats": side_cells(rec, s)}
    cells["release"], canary = release_cells(rec, s)
    channels = []
    for name, (observer, sees) in CHANNELS.items():
        attacks_ = [{"attack": a, "gated": g, **cells[name][a]} for c, a, g in BATTERY
                    if c == name]
        channels.append({"channel": name, "observer": observer, "sees": sees,
                         "recorded": _recorded(rec, name), "attacks": attacks_})
    encoder_pool, encoder_sigma = encoder_pool_sigma(cfg, rec.groups)
    return {"run_dir": str(run_dir), "battery_size": s.m, "margin_pp": s.margin_pp,
            "family_alpha": s.family_alpha, "per_test_level": s.family_alpha / s.m,
            "notes": notes, "channels": channels, "canary": canary,
            "alpha_sweep": (sweep or alpha_sweep)(rec, s),
            "privacy": {"noise_multiplier": cfg.privacy.noise_multiplier,
                        "clip_norm": cfg.privacy.clip_norm, "alpha": cfg.privacy.alpha,
                        "clipping": cfg.privacy.clipping, "delta": cfg.privacy.delta,
                        "accountant": cfg.privacy.accountant,
                        "encoder_pool": encoder_pool, "encoder_sigma": encoder_sigma}}


def encoder_pool_sigma(cfg: Config, groups: list[dict]) -> tuple[str | None, float | None]:
    """The pool holding the encoder's groups under the run's own clipping policy and its
    effective noise multiplier σ·C/C_k (σ/√α only for α-split; σ for a single pool). None when
    the run has no DP mechanism, no encoder groups, or a policy that cannot be rebuilt here
    (e.g. ``probe`` without its norms file)."""
    encoder = [g["name"] for g in groups if g.get("component") == "encoder"]
    if cfg.privacy.mechanism != "gaussian" or not encoder:
        return None, None
    specs = [GroupSpec(g["name"], g["component"], int(g["numel"])) for g in groups]
    try:
        policy = make_policy(cfg.privacy, specs)
    except (ConfigError, ValueError, OSError):
        return None, None
    pool = policy.pool_of()[encoder[0]]
    return pool, effective_noise_multipliers(policy, cfg.privacy.sigma)[0][pool]


def _recorded(rec: Recording, name: str) -> bool:
    return {"uploads": rec.uploads is not None, "partial_sums": rec.partials is not None,
            "release": rec.releases is not None,
            "side_stats": rec.uploads is not None}[name]


__all__ = ["run_battery", "Settings", "gated_probe", "linkability_cell", "zero_cell"]
