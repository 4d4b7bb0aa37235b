"""``cluster-fl calibrate CONFIG``: a non-private norm probe on PUBLIC speakers -> recommended α.

Owns the α calibration of DESIGN §3. The probe never touches the private clients: it loads the
``public`` split of ``data.languages``, keeps ``--speakers`` of its speakers (language-balanced,
via ``partition_clients``) as pseudo-clients, and trains each one, from the same global state
(the configured model, ``model.checkpoint`` included), with the engine's ``ClientRunner`` and the
config's ``fl``/``client`` settings (local epochs, steps, LR and per-component LR multipliers).
No clipping, no noise: it only measures ‖Δ_h‖₂ per trainable group h.

Definitions (the ``--json`` contract, see :func:`calibrate`):

* group mean norm m_h = mean over pseudo-clients of ‖Δ_h‖₂ (non-finite updates are excluded and
  counted); component mean m_c = mean of m_h over the groups of component c;
* ratio = m_decoder / m_encoder: mean decoder-group norm over mean encoder-group norm, with
  groups of component ``decoder`` only (the connector is reported separately and not in the
  ratio: its full weight matrices are not comparable with LoRA factors);
* the rule works on what the config clips (``privacy.grouping``): its clipping units u (one
  group each under ``matrix``; one transformer layer of a component under ``layer``,
  ``cluster_fl.groups.clipping_units``), with unit mean norm m_u = mean over pseudo-clients of
  ‖Δ_u‖₂ = √(Σ_{h∈u} ‖Δ_h‖₂²) and m_encoder_units = mean of m_u over the encoder units. Under
  ``layer`` grouping a threshold bounds a whole layer's update, which is ~√(matrices per layer)
  times one matrix's: comparing it with a matrix norm would ask for far too small an α;
* recommended α: under ``alpha-split`` with the ``size`` rule an encoder unit's threshold is
  C·√α·√(p_u/P_E), so the median encoder-unit threshold is √α·t₁ with t₁ its value at α = 1.
  We solve √α·t₁ = HEADROOM·m_encoder_units (HEADROOM = 2: "encoder threshold ≈ 2× the observed
  norm", so few encoder updates are clipped) and clamp α to [ALPHA_MIN, ALPHA_MAX];
* the decoder pool keeps √(1−α) of C; each decoder-pool unit keeps √((1−α)·P/P_D) of its
  single-pool ``size`` threshold (the paper's "LM per-layer 0.1465 vs global 0.1474");
* per-pool effective σ_k = σ/√α_k from ``privacy.effective_noise_multipliers``.

Advice (the paper: Whisper+TinyLlama ≈ 10× → α-split with α = 0.05; Voxtral ≈ 1.7× → adaptive
single-pool wins): ratio ≥ HEAVY_RATIO (5) → ``alpha-split`` with the small α; ratio ≤
MILD_RATIO (2) → ``size-ema``; in between both are worth running. 5 and 2 bracket the geometric
middle (√(1.7·10) ≈ 4.1) of the paper's two observed regimes, leaning to α-split only when the
imbalance is clearly heavy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, Sequence

import yaml

from cluster_fl.config import Config, load_config, parse_override
from cluster_fl.errors import UserError
from cluster_fl.groups import GroupSpec, clipping_units

HEADROOM = 2.0
ALPHA_MIN, ALPHA_MAX = 0.005, 0.5
HEAVY_RATIO, MILD_RATIO = 5.0, 2.0
PUBLIC_SPLIT = "public"  # the embedded corpus's; a config names its own (data.public_split)


# ---- the probe ---------------------------------------------------------------------------
def _device(cfg: Config) -> str:
    import torch

    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device: cuda requested but no CUDA device is available")
    if cfg.run.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.run.device


def probe_norms(cfg: Config, speakers: int = 8, rounds: int = 1) -> dict[str, Any]:
    """Train ``speakers`` public pseudo-clients from one global state; per-client group norms.

    With ``rounds`` > 1 the probe runs plain non-private FedAvg (global += mean update) and
    pools the norms of every round: LoRA B starts at zero, so the first round of a fresh model
    is atypical (its A factors only move from the second local step on).
    Returns ``{"groups": [GroupSpec], "norms": {group: [norm per finite update]},
    "clients": [{round, client_id, speaker, language, utterances, steps, loss, finite}]}``.
    """
    import torch

    from cluster_fl.data import FeatureStore, load_utterances, partition_clients
    from cluster_fl.engine.client import ClientRunner
    from cluster_fl.engine.setup import make_batches
    from cluster_fl.models import build_model, get_trainable, trainable_groups
    from cluster_fl.models.lora import _trainable_params
    from cluster_fl.privacy.clipping import safe_norm
    from cluster_fl.seeding import derive_seed

    if speakers < 1 or rounds < 1:
        raise UserError(f"--speakers and --rounds must be >= 1 (got {speakers}, {rounds})")
    d = cfg.data
    root = os.path.expanduser(d.corpus)
    if not os.path.isdir(root):
        raise UserError(f"data.corpus: no corpus at {root} (build one with `cluster-fl "
                        "make-corpus DIR` or point data.corpus at an MLS folder)")
    utts = load_utterances(root, languages=list(d.languages), splits=[d.public_split])
    pseudo = partition_clients(utts, max_clients=speakers,
                               max_utterances_per_client=d.max_utterances_per_client)
    if not pseudo:
        raise UserError(f"data: no speakers in split {d.public_split!r} for languages "
                        f"{','.join(d.languages)} under {root}; the probe uses public data only")
    store = FeatureStore.from_config(cfg.data)  # resolved at the entrance: the model's mel bins
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    # Same seed -> same random init, so two probes differ only in what the caller changed.
    torch.manual_seed(derive_seed(cfg.run.seed, "calibrate-init"))
    model = build_model(cfg.model, run_seed=cfg.run.seed).to(_device(cfg))
    groups = trainable_groups(model)
    state = get_trainable(model)
    runner = ClientRunner(model, dict(_trainable_params(model)), groups, cfg.fl, cfg.client,
                          make_batches, derive_seed(cfg.run.seed, "calibrate"))
    norms: dict[str, list[float]] = {g.name: [] for g in groups}
    clients = []
    data = [(c, store.client(c)) for c in pseudo]
    for r in range(rounds):
        total = {name: torch.zeros_like(t) for name, t in state.items()}
        n_finite = 0
        for c, examples in data:
            if not examples:
                continue
            upd = runner.train(c.index, examples, state, r)
            row = {name: safe_norm(upd.delta[name]) for name in norms}
            finite = all(math.isfinite(v) for v in row.values())
            if finite:
                n_finite += 1
                for name, v in row.items():
                    norms[name].append(v)
                    total[name] += upd.delta[name]
            clients.append({"round": r, "client_id": c.client_id, "speaker": c.speaker,
                            "language": c.language, "utterances": len(examples),
                            "steps": upd.steps, "loss": upd.loss, "finite": finite})
        if n_finite:  # non-private FedAvg step; the probe is public data, nothing to protect
            state = {name: t + total[name] / n_finite for name, t in state.items()}
    if not any(cl["finite"] for cl in clients):
        raise UserError("calibrate: every probe update was non-finite (or had no data); lower "
                        "fl.lr or set client.max_grad_norm")
    return {"groups": groups, "norms": norms, "clients": clients, "rounds": rounds,
            "split": d.public_split}


# ---- from norms to a recommendation ------------------------------------------------------
def advise(ratio: float | None) -> tuple[str, str]:
    """(recommended clipping method, one-paragraph advice) for a decoder/encoder norm ratio."""
    if ratio is None:
        return "size", ("No encoder groups are trained (frozen encoder): alpha-split has only "
                        "the decoder pool and equals size clipping; alpha does not matter.")
    if ratio >= HEAVY_RATIO:
        return "alpha-split", (
            f"Heavy imbalance (decoder/encoder {ratio:.1f}x >= {HEAVY_RATIO:g}x; paper: "
            "Whisper+TinyLlama ~10x): single-pool per-layer clipping lets the many small encoder "
            "groups take budget the decoder needs. Use alpha-split with the small recommended alpha: "
            "the decoder keeps nearly the global budget and the encoder pool gets a larger "
            "effective noise multiplier.")
    if ratio <= MILD_RATIO:
        return "size-ema", (
            f"Mild imbalance (decoder/encoder {ratio:.1f}x <= {MILD_RATIO:g}x; paper: Voxtral "
            "~1.7x): a fixed small encoder share over-clips an encoder whose updates are "
            "comparable to the decoder's. Prefer an adaptive single-pool method (size-ema); "
            "the recommended alpha is reported for completeness.")
    return "alpha-split", (
        f"Intermediate imbalance (decoder/encoder {ratio:.1f}x, between {MILD_RATIO:g}x and "
        f"{HEAVY_RATIO:g}x): both alpha-split with the recommended alpha and an adaptive single-pool "
        "method (size-ema) are worth running; the paper has no architecture in this range.")


def _mean(xs: Sequence[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


def unit_norms(groups: Sequence[GroupSpec], norms: dict[str, list[float]], grouping: str
               ) -> dict[str, float]:
    """Mean over pseudo-clients of each clipping unit's norm ‖Δ_u‖₂ = √(Σ_{h∈u} ‖Δ_h‖₂²) for
    ``privacy.grouping`` (``norms``: per group, one norm per finite update, in client order --
    :func:`probe_norms`' layout). Under ``matrix`` grouping these are the group mean norms."""
    from cluster_fl.privacy.clipping import combine_norms

    out = {}
    for u in clipping_units(groups, grouping):
        per_client = [combine_norms(list(ns)) for ns in zip(*(norms[h] for h in u.members))]
        out[u.name] = _mean(per_client)
    return out


def recommend(groups: Sequence[GroupSpec], norms: dict[str, float], privacy: Any
              ) -> dict[str, Any] | None:
    """Recommended α and what it implies under alpha-split/size (module docstring), or None
    when no encoder group exists. ``norms`` maps every clipping unit of ``privacy.grouping``
    (:func:`unit_norms`; under ``matrix`` grouping: every group) to its mean norm; ``privacy``
    gives C, σ and the grouping (a ``PrivacyConfig``)."""
    from cluster_fl.privacy import effective_noise_multipliers, make_policy

    units = clipping_units(groups, privacy.grouping)
    enc = [u for u in units if u.component == "encoder"]
    if not enc:
        return None
    m_enc = _mean([norms[u.name] for u in enc])
    if not m_enc or m_enc <= 0:
        raise UserError("calibrate: the encoder groups did not move (client.lr_encoder_mult=0?);"
                        " use model.freeze_encoder=true instead of alpha-split")

    def policy_at(alpha: float):
        cfg = dataclasses.replace(privacy, clipping="alpha-split", inside_pool="size", alpha=alpha)
        return make_policy(cfg, groups)

    def median_enc_threshold(policy) -> float:
        thr = policy.unit_thresholds()
        return statistics.median(thr[u.name] for u in enc)

    t_half = median_enc_threshold(policy_at(0.5))  # thresholds scale exactly as √α
    raw = 0.5 * (HEADROOM * m_enc / t_half) ** 2
    alpha = min(ALPHA_MAX, max(ALPHA_MIN, raw))
    policy = policy_at(alpha)
    t_enc = median_enc_threshold(policy)
    size_thr = make_policy(dataclasses.replace(privacy, clipping="size"), groups).unit_thresholds()
    thr = policy.unit_thresholds()
    dec_pool = [u for u in units if u.component != "encoder"]
    pool_sigma, _ = effective_noise_multipliers(policy, privacy.noise_multiplier)
    return {
        "alpha": alpha, "alpha_unclamped": raw, "clamped": raw != alpha,
        "inside_pool": "size", "clip_norm": privacy.clip_norm,
        "noise_multiplier": privacy.noise_multiplier, "grouping": privacy.grouping,
        "encoder_units": len(enc), "encoder_unit_norm": m_enc,
        "encoder_threshold_median": t_enc,
        "encoder_headroom": t_enc / m_enc,  # = HEADROOM unless α was clamped
        "decoder_pool_budget": math.sqrt(1.0 - alpha) if dec_pool else 0.0,
        "decoder_vs_size": (_mean([thr[u.name] / size_thr[u.name] for u in dec_pool])
                            if dec_pool else None),
        "effective_noise_multipliers": pool_sigma,
    }


def summarise(probe: dict[str, Any], privacy: Any) -> dict[str, Any]:
    """Group/component means, ratio, recommendation and advice from :func:`probe_norms`."""
    groups: list[GroupSpec] = probe["groups"]
    mean_norms = {g.name: _mean(probe["norms"][g.name]) for g in groups}
    table = []
    for g in groups:
        xs = probe["norms"][g.name]
        table.append({"name": g.name, "component": g.component, "numel": g.numel,
                      "mean_norm": mean_norms[g.name],
                      "std_norm": statistics.pstdev(xs) if xs else None})
    components = {}
    for comp in ("encoder", "connector", "decoder"):
        vals = [mean_norms[g.name] for g in groups if g.component == comp]
        if vals:
            components[comp] = _mean(vals)
    m_enc, m_dec = components.get("encoder"), components.get("decoder")
    ratio = m_dec / m_enc if m_enc and m_dec is not None else None
    by_unit = unit_norms(groups, probe["norms"], privacy.grouping)
    units = [{"name": u.name, "component": u.component, "numel": u.numel,
              "members": list(u.members), "mean_norm": by_unit[u.name]}
             for u in clipping_units(groups, privacy.grouping)]
    rec = recommend(groups, by_unit, privacy)
    method, text = advise(ratio)
    warnings = []
    if max(c["steps"] for c in probe["clients"]) <= 1:
        warnings.append("every pseudo-client took one local step: LoRA A factors cannot move on "
                        "the first step (B starts at 0) and AdamW's first step has norm "
                        "lr*sqrt(entries); lower fl.batch_size or raise fl.local_epochs")
    still = sum(1 for m in mean_norms.values() if not m)
    if still:
        warnings.append(f"{still} group(s) did not move in the probe (mean norm 0)")
    return {"groups": table, "grouping": privacy.grouping, "units": units,
            "components": components, "ratio": ratio, "recommendation": rec,
            "method": method, "advice": text, "warnings": warnings,
            "probe": {"split": probe.get("split", PUBLIC_SPLIT), "rounds": probe["rounds"],
                      "clients": probe["clients"],
                      "n_nonfinite": sum(not c["finite"] for c in probe["clients"])}}


def calibrate(cfg: Config, speakers: int = 8, rounds: int = 1) -> dict[str, Any]:
    """Probe + summary: the ``--json`` result.

    Keys: ``arch``, ``freeze_encoder``, ``groups`` [{name, component, numel, mean_norm,
    std_norm}], ``grouping`` (``privacy.grouping``), ``units`` [{name, component, numel,
    members, mean_norm}] (the clipping units the rule works on), ``components`` {component: mean
    group norm}, ``ratio`` (float or null), ``recommendation`` (null for a frozen encoder)
    {alpha, alpha_unclamped, clamped, inside_pool, clip_norm, noise_multiplier, grouping,
    encoder_units, encoder_unit_norm, encoder_threshold_median, encoder_headroom,
    decoder_pool_budget, decoder_vs_size, effective_noise_multipliers {pool: σ_k}},
    ``method``, ``advice``, ``warnings`` [str], ``probe`` {split, rounds, clients,
    n_nonfinite}.
    """
    out = summarise(probe_norms(cfg, speakers, rounds), cfg.privacy)
    return {"arch": cfg.model.arch, "freeze_encoder": cfg.model.freeze_encoder, **out}


# ---- writing a preset ---------------------------------------------------------------------
def write_preset(result: dict[str, Any], config_path: str | Path, overrides: Sequence[str],
                 out: str | Path) -> tuple[Path, Path]:
    """Write ``OUT.yaml`` (base: the input config; the probe's overrides; privacy.clipping,
    privacy.alpha, privacy.probe_norms) and ``OUT.norms.json`` ({"norms": {group: m_h}});
    returns both paths."""
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    norms_path = out.with_name(out.stem + ".norms.json")
    # `probe` clipping needs a positive norm for every group; a group that did not move in the
    # probe (e.g. LoRA A after a single local step) gets the smallest observed norm instead.
    floor = min((g["mean_norm"] for g in result["groups"] if g["mean_norm"]), default=1.0)
    norms = {g["name"]: g["mean_norm"] or floor for g in result["groups"]}
    norms_path.write_text(json.dumps({"arch": result["arch"], "ratio": result["ratio"],
                                      "norms": norms}, indent=1) + "\n")
    tree: dict[str, dict[str, Any]] = {}
    for text in overrides:  # the preset reproduces the config that was probed
        key, value = parse_override(text)
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = value
    priv = tree.setdefault("privacy", {})
    priv["clipping"] = result["method"]
    rec = result["recommendation"]
    if rec is not None:
        priv["alpha"] = float(f"{rec['alpha']:.4g}")
    priv["probe_norms"] = str(norms_path.resolve())
    base_abs, here = Path(config_path).expanduser().resolve(), Path.cwd().resolve()
    # relative inside one project tree (presets stay portable in a repo), else absolute
    inside = base_abs.is_relative_to(here) and out.parent.resolve().is_relative_to(here)
    base = os.path.relpath(base_abs, out.parent.resolve()) if inside else str(base_abs)
    ratio = result["ratio"]
    header = [f"# Written by `cluster-fl calibrate` (public-speaker probe, {result['arch']}).",
              f"# decoder/encoder norm ratio: {'n/a' if ratio is None else f'{ratio:.3g}x'}; "
              f"recommended: {result['method']}"
              + ("" if rec is None else f" with alpha = {rec['alpha']:.4g}"),
              "# Switch to privacy.clipping: probe to allocate by the probe norms instead."]
    body = yaml.safe_dump({"base": base, **tree}, sort_keys=False)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text("\n".join(header) + "\n" + body)
    os.replace(tmp, out)
    load_config(out)  # what we wrote must load; a ConfigError here is a bug worth seeing
    return out, norms_path


# ---- CLI ----------------------------------------------------------------------------------
def format_result(r: dict[str, Any]) -> str:
    """The human-readable report."""
    p = r["probe"]
    lines = [f"calibrate {r['arch']} (freeze_encoder={r['freeze_encoder']}): probe on "
             f"{len({c['client_id'] for c in p['clients']})} public speaker(s) x {p['rounds']} "
             f"round(s), {p['n_nonfinite']} non-finite update(s)"]
    for comp, m in r["components"].items():
        n = sum(g["component"] == comp for g in r["groups"])
        lines.append(f"  {comp:<9} {n:4d} groups  mean group norm {m:.4g}")
    if r["ratio"] is not None:
        lines.append(f"  decoder/encoder norm ratio: {r['ratio']:.3g}x")
    rec = r["recommendation"]
    if rec is not None:
        clamp = f" (clamped from {rec['alpha_unclamped']:.3g})" if rec["clamped"] else ""
        sig = ", ".join(f"{k} {v:.4g}" for k, v in rec["effective_noise_multipliers"].items())
        unit = "layer" if rec["grouping"] == "layer" else "matrix"
        lines += [f"  recommended alpha: {rec['alpha']:.4g}{clamp} (privacy.grouping: "
                  f"{rec['grouping']}: {rec['encoder_units']} encoder clipping units)",
                  f"    median encoder {unit} threshold {rec['encoder_threshold_median']:.4g} = "
                  f"{rec['encoder_headroom']:.2f}x the mean encoder {unit} norm "
                  f"{rec['encoder_unit_norm']:.4g} (C = {rec['clip_norm']:g})",
                  f"    decoder pool keeps sqrt(1-alpha) = {rec['decoder_pool_budget']:.4f} of C; "
                  f"its {unit}s keep {rec['decoder_vs_size']:.4f} of their single-pool size "
                  "thresholds",
                  f"    effective sigma per pool (sigma = {rec['noise_multiplier']:g}): {sig}"]
    lines += [f"  advice: {r['method']}", "  " + r["advice"]]
    lines += [f"  warning: {w}" for w in r["warnings"]]
    return "\n".join(lines)
