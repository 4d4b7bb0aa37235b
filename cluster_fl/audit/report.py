"""The audit report: ``report.json`` (the full battery), ``report.md`` and ``dose_response.png``.

The markdown lists EVERY declared channel and, under it, every declared attack -- measured with
its statistic, bound, gate and verdict, or ``not measured`` with the reason -- then the canary ε
lower bound against the accounted ε, the dose–response onsets and the α sweep.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.{nd}f}"
    return str(x)


def render_markdown(rep: dict) -> str:
    """The human-readable report."""
    lines = [f"# Privacy audit of `{rep['run_dir']}`", "",
             f"Gate (fixed in config): attack accuracy − constant-guess baseline; one-sided "
             f"Clopper–Pearson upper bound at level {rep['family_alpha']}/{rep['battery_size']} "
             f"= {rep['per_test_level']:.4g} (Bonferroni over the {rep['battery_size']} gated "
             f"cells declared); fail above {rep['margin_pp']} pp. A cell whose positive control "
             "does not fire is `underpowered`, never `pass`.", ""]
    for note in rep.get("notes", []):
        lines.append(f"> note: {note}")
    lines += ["## Channels × attacks", "",
              "| channel | observer | attack | status | acc | baseline | excess pp | CP upper pp "
              "| Wilson upper pp | shuffled twin upper pp | onset dose | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ch in rep["channels"]:
        for a in ch["attacks"]:
            g = a.get("gate", {})
            neg = a.get("negative_control", {})
            status = a["status"] if a["status"] == "measured" else f"not measured: {a['reason']}"
            lines.append("| " + " | ".join([
                ch["channel"], ch["observer"], a["attack"], status, _f(g.get("accuracy"), 3),
                _f(g.get("baseline"), 3), _f(g.get("excess_pp")), _f(g.get("upper_cp_pp")),
                _f(g.get("upper_wilson_pp")), _f(neg.get("upper_cp_pp")),
                _f(a.get("onset_dose")), f"**{a['verdict']}**"]) + " |")
    lines += ["", "Structural checks (exact-zero support):", ""]
    for ch in rep["channels"]:
        for a in ch["attacks"]:
            if a["attack"] == "zero_support" and a["status"] == "measured":
                st = a["structure"]
                lines.append(f"- {ch['channel']}: flagged={st['flagged']}; varying "
                             f"{[v['group'] for v in st['varying']][:5]}; constant-zero "
                             f"{[c['group'] for c in st['constant_zero']][:5]}")
    lines += ["", "## Canary ε lower bound vs accountant", ""]
    can = rep.get("canary")
    if can and can.get("status") == "measured":
        c = can["canary"]
        b = c["bound"]
        lines += [
            "Mechanism: one round, canary always in the cohort when inserted (q = 1), add/remove; "
            "canary = per-group random direction at its threshold (‖c‖ = C); statistic = "
            "projection of (release·n − Σ other uploads) on the canary.",
            f"- noise: {c['noise_source']}; claimed std {_f(c['noise_std_claimed'], 4)}, "
            f"measured {_f(c['noise_std_measured'], 4)}",
            f"- ε lower bound {_f(b['epsilon_lb'], 3)} (TPR {_f(b['tpr'], 3)}, FPR "
            f"{_f(b['fpr'], 3)}, {b['n_in']}+{b['n_out']} trials, {b['thresholds_tried']} "
            f"thresholds, confidence {1 - b['alpha']:.2f}); instrument ceiling {_f(b['ceiling'], 3)}",
            f"- accounted ε (one round, σ = {rep['privacy']['noise_multiplier']}, δ = "
            f"{rep['privacy']['delta']}, {rep['privacy']['accountant']}): "
            f"{_f(c['accounted_epsilon'], 3)}; exact Gaussian ε {_f(c['exact_epsilon'], 3)}",
            f"- verdict **{c['verdict']}**: {c['reason']}", "",
            "| noise scale | ε lower bound |", "|---|---|"]
        lines += [f"| {d['noise_scale']} | {_f(d['epsilon_lb'], 3)} |" for d in can["dose_response"]]
    else:
        lines.append("not measured" + (f": {can['reason']}" if can else ""))
    lines += ["", "## α sweep: speaker inference on the encoder channel", "",
              "| α | effective σ (σ/√α) | accuracy | baseline | excess pp | CP upper pp | verdict |",
              "|---|---|---|---|---|---|---|"]
    for r in rep.get("alpha_sweep", []):
        lines.append(f"| {r['alpha']} | {_f(r['effective_sigma'], 3)} | {_f(r['accuracy'], 3)} | "
                     f"{_f(r['baseline'], 3)} | {_f(r['excess_pp'])} | {_f(r['upper_cp_pp'])} | "
                     f"{r['verdict']} |")
    if not rep.get("alpha_sweep"):
        lines.append("not measured: no encoder groups in the recorded uploads")
    lines += ["", "Dose–response curves: `dose_response.png` (planted label-aligned leak of "
              "relative size `dose` on a shuffled-label base; canary: noise scale)."]
    return "\n".join(lines) + "\n"


def plot_dose_response(rep: dict, path: Path) -> None:
    """Three panels: gated metrics vs planted dose, canary ε vs noise scale, α sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    for ch in rep["channels"]:
        for a in ch["attacks"]:
            curve = a.get("dose_response")
            if a.get("status") != "measured" or not curve or "excess_pp" not in curve[0]:
                continue
            xs = [max(c["dose"], 1e-3) for c in curve]
            ax[0].plot(xs, [c["lower_cp_pp"] for c in curve], marker="o",
                       label=f"{ch['channel']}:{a['attack']}")
    ax[0].axhline(rep["margin_pp"], color="k", ls="--", lw=1, label="margin")
    ax[0].set(xscale="log", xlabel="planted dose (0 shown at 1e-3)",
              ylabel="CP lower bound of excess (pp)", title="metric dose–response")
    ax[0].legend(fontsize=6)
    can = rep.get("canary")
    if can and can.get("status") == "measured":
        xs = [max(d["noise_scale"], 1e-3) for d in can["dose_response"]]
        ax[1].plot(xs, [d["epsilon_lb"] for d in can["dose_response"]], marker="o",
                   label="ε lower bound")
        ax[1].axhline(can["canary"]["accounted_epsilon"], color="r", ls="--",
                      label="accounted ε (nominal σ)")
        ax[1].set(xscale="log", xlabel="noise scale (0 shown at 1e-3)", ylabel="ε",
                  title="canary")
        ax[1].legend(fontsize=7)
    sweep = rep.get("alpha_sweep") or []
    if sweep:
        ax[2].plot([r["alpha"] for r in sweep], [r["excess_pp"] for r in sweep], marker="o",
                   label="speaker excess (pp)")
        ax[2].set(xscale="log", xlabel="α", ylabel="excess (pp)", title="α sweep (encoder)")
        tw = ax[2].twinx()
        tw.plot([r["alpha"] for r in sweep], [r["effective_sigma"] for r in sweep], "r--",
                label="σ/√α")
        tw.set_ylabel("effective σ")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(rep: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md and dose_response.png into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md",
             "plot": out / "dose_response.png"}
    paths["json"].write_text(json.dumps(rep, indent=1, default=_json_default))
    paths["md"].write_text(render_markdown(rep))
    plot_dose_response(rep, paths["plot"])
    return paths


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
