"""``cluster-fl plot RESULTS... --out DIR``: the paper's figures as PNG (matplotlib, Agg).

* ``norms__<cell>.png`` -- per-group mean pre-clip client update norm (``norm/<group>`` averaged
  over rounds and seeds), groups sorted by norm, log scale, coloured by component, with the server
  noise floor as a band. **Noise floor**: the server adds N(0, σ²C²·I) to the sum of n clipped
  updates and divides by n, so group h (p_h coordinates) of the released mean carries noise of
  expected L2 norm ≈ σ·C·√p_h / n. Each bar gets its own floor (a step line); the band spans the
  floors of the smallest and the largest group. A bar near or under its floor is drowned by noise.
  σ and C come from the run's config (a non-private run shows the floor its σ, C would give).
* ``flat_dynamics__<arch>__<condition>.png`` -- flat DP over rounds: total pre-clip norm, clip
  rate, retained ratio (clipped/raw norm), mean over seeds.
* ``pools__<cell>.png`` -- per-pool clip rate (top) and mean norm against the pool's threshold
  (bottom) over rounds, for multi-pool runs (alpha-split, pools).
* ``sigma_vs_alpha.png`` -- effective noise multiplier per pool against α: the curves σ/√α
  (encoder pool) and σ/√(1−α) (connector + decoder pool), with the runs' recorded σ_k as points.
* ``wer_vs_alpha.png`` -- WER (mean ± std over seeds) against α per arch × condition, with flat
  DP as a dashed reference where present.
* ``wer_by_method.png`` -- one panel per arch × condition: WER per method (bar: mean over seeds,
  whisker: the WER table's 95% hierarchical CI over seeds and speakers, dots: the seeds), the
  starting model (``round-0``) as a dotted line where present.
* ``clip_rates__<arch>__<condition>.png`` -- per round, mean over seeds: the fraction of clients
  clipped, one line per DP method (left), and the fraction of each pool's update norm that
  survives clipping, one line per method × pool (right: where C binds for every client the clip
  rate is 1 throughout, and the retained fraction is what tells the methods apart); the pool
  sets the colour, the method the line style.
* ``wer_by_round__<arch>__<condition>.png`` -- test WER against round, one line per method
  (mean over seeds), where the runs evaluated during training (``eval.every``), ending at the
  final evaluation; the starting model (``round-0``) at round 0.

Every figure keeps its legend outside the plotting area (it never covers a line), and a pool has
one colour in every figure (:func:`pool_colour`: encoder, connector and decoder as in the norm
bars, other pool names from a palette that reuses none of them).

In ``norms__<cell>.png`` a method with per-group thresholds also shows each group's reported
threshold C_h (mean over rounds; under ``privacy.grouping: layer`` a group carries its layer's
threshold, which bounds the layer's joint norm).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from cluster_fl.report.results import Run

COLOURS = {"encoder": "#1f77b4", "connector": "#ff7f0e", "decoder": "#2ca02c"}
# pools that are not a component (K pools' own names; "all" for single-pool methods)
OTHER_POOL_COLOURS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
METHOD_STYLES = ("-", "--", ":", "-.")


def pool_colour(pool: str, others: Sequence[str] = ()) -> str:
    """The colour of pool ``pool`` in every figure: its component's, black for ``all``, else
    one of :data:`OTHER_POOL_COLOURS` by its rank among ``others`` (the figure's other pool
    names, sorted), so two pools of one figure never share a colour."""
    if pool in COLOURS:
        return COLOURS[pool]
    if pool == "all":
        return "#000000"
    rest = sorted(p for p in set(others) | {pool} if p not in COLOURS and p != "all")
    return OTHER_POOL_COLOURS[rest.index(pool) % len(OTHER_POOL_COLOURS)]


def legend_outside(ax, **kw) -> None:
    """The axes' legend to the right of the plotting area, where it cannot cover a line."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                  fontsize=kw.pop("fontsize", 7), **kw)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text.replace("α=", "alpha")).strip("-")


def _cells(runs: Sequence[Run]) -> dict[tuple[str, str, str], list[Run]]:
    cells: dict[tuple[str, str, str], list[Run]] = defaultdict(list)
    for r in runs:
        cells[(r.arch, r.condition, r.method)].append(r)
    return cells


def _mean_over_rounds(runs: Sequence[Run], column: str) -> float:
    """Mean over every round of every run (runs with more rounds weigh more)."""
    values = [v for r in runs for v in r.round_values(column)]
    return float(np.mean(values)) if values else math.nan


def _per_round(runs: Sequence[Run], column: str) -> tuple[np.ndarray, np.ndarray]:
    """Rounds and the seed-mean of ``column`` per round."""
    by_round: dict[int, list[float]] = defaultdict(list)
    for r in runs:
        for row in r.rounds:
            if row.get(column) is not None:
                by_round[int(row["round"])].append(float(row[column]))
    rounds = sorted(by_round)
    return np.array(rounds), np.array([np.mean(by_round[k]) for k in rounds])


def noise_floor(sigma: float, clip: float, numel: int, n_clients: float) -> float:
    """Expected L2 norm of the server noise on one group of the released mean: σ·C·√p / n."""
    return sigma * clip * math.sqrt(numel) / max(n_clients, 1.0)


def _save(fig, path: Path) -> bool:
    """Lay out, write the PNG, free the figure; True = the figure was made."""
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # legends outside the axes stay in the file
    fig.clf()
    _plt().close(fig)
    return True


def plot_norms(runs: Sequence[Run], title: str, path: Path) -> bool:
    """Per-group mean update norms (log scale) coloured by component, with the noise-floor band."""
    groups = runs[0].groups
    if not groups or not runs[0].rounds:
        return False
    norms = [(g, _mean_over_rounds(runs, f"norm/{g['name']}")) for g in groups]
    norms = sorted([(g, v) for g, v in norms if v > 0 and math.isfinite(v)], key=lambda t: -t[1])
    if not norms:
        return False
    sigma = float(runs[0].setting("privacy", "noise_multiplier", 0.1))
    clip = float(runs[0].setting("privacy", "clip_norm", 1.0))
    n = _mean_over_rounds(runs, "n_clients")
    floors = [noise_floor(sigma, clip, int(g["numel"]), n if math.isfinite(n) else 1.0) for g, _ in norms]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * len(norms) + 3), 4))
    x = np.arange(len(norms))
    ax.bar(x, [v for _, v in norms], color=[COLOURS.get(g["component"], "grey") for g, _ in norms],
           width=0.85)
    ax.axhspan(min(floors), max(floors), color="#e377c2", alpha=0.2,
               label=f"server noise floor σC√p_h/n (σ={sigma:g}, C={clip:g}, n={n:.0f})")
    ax.step(x, floors, where="mid", color="#e377c2", lw=1)
    for comp, colour in COLOURS.items():
        if any(g["component"] == comp for g, _ in norms):
            ax.bar([0], [0], color=colour, label=comp)
    thresholds = [_mean_over_rounds(runs, f"threshold/{g['name']}") for g, _ in norms]
    if any(math.isfinite(t) and t > 0 for t in thresholds):
        ax.scatter(x, thresholds, marker="_", s=120, color="k", zorder=3,
                   label="clipping threshold C_h (mean over rounds)")
    ax.set_yscale("log")
    ax.set_xticks(x if len(norms) <= 40 else [])
    if len(norms) <= 40:
        ax.set_xticklabels([g["name"] for g, _ in norms], rotation=90, fontsize=6)
    ax.set_xlabel("trainable group (sorted by norm)")
    ax.set_ylabel("mean update norm ‖Δθ_h‖₂")
    ax.set_title(title, fontsize=9)
    legend_outside(ax)
    return _save(fig, path)


def _noise_note(runs: Sequence[Run]) -> str:
    """A title suffix when the diagnostics were noised (privacy.diagnostics: noised): the plotted
    rates and norms are then noisy by design and may leave [0, 1] or go negative."""
    stds = [float(row.get("diag_noise_std") or 0.0) for r in runs for row in r.rounds
            if row.get("diagnostics") == "noised"]
    if not stds:
        return ""
    return f"\nnoised diagnostics (DP): ± {np.mean(stds):.2f} per rate, per round"


def plot_flat_dynamics(runs: Sequence[Run], title: str, path: Path) -> bool:
    """Total norm (left axis), clip rate and retained ratio (right axis) over rounds."""
    rounds, total = _per_round(runs, "total_norm")
    if len(rounds) == 0:
        return False
    _, clip_rate = _per_round(runs, "clip_rate")
    retained_cols = sorted({k for r in runs for row in r.rounds for k in row if k.startswith("retained/")})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rounds, total, "k--", label="total update norm")
    ax.set_xlabel("round")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean pre-clip total norm")
    right = ax.twinx()
    if len(clip_rate):
        right.plot(rounds, clip_rate, color="tab:red", label="clip rate")
    for col in retained_cols:
        rr, retained = _per_round(runs, col)
        right.plot(rr, retained, color="tab:purple", label=f"retained ratio ({col.split('/', 1)[1]})")
    right.set_ylim(0, 1.05)
    right.set_ylabel("fraction")
    lines = ax.get_legend_handles_labels()
    lines2 = right.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.12, 1.0), borderaxespad=0.0)  # beside the right-hand axis
    ax.set_title(title + _noise_note(runs), fontsize=9)
    return _save(fig, path)


def plot_pools(runs: Sequence[Run], title: str, path: Path) -> bool:
    """Per-pool clip rate (top) and mean norm vs threshold (bottom) over rounds."""
    pools = sorted({k.split("/", 1)[1] for r in runs for row in r.rounds for k in row
                    if k.startswith("clip_rate/")})
    if len(pools) < 2:
        return False
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for pool in pools:
        c = pool_colour(pool, pools)
        top.plot(*_per_round(runs, f"clip_rate/{pool}"), color=c, label=pool)
        bottom.plot(*_per_round(runs, f"mean_norm/{pool}"), color=c, label=f"{pool} mean norm")
        bottom.plot(*_per_round(runs, f"threshold/{pool}"), color=c, ls="--", label=f"{pool} threshold")
    top.set_ylabel("clients clipped (fraction)")
    top.set_ylim(0, 1.05)
    legend_outside(top)
    bottom.set_yscale("log")
    bottom.set_ylabel("pool norm")
    bottom.set_xlabel("round")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    legend_outside(bottom)
    top.set_title(title + _noise_note(runs), fontsize=9)
    return _save(fig, path)


def plot_sigma_vs_alpha(runs: Sequence[Run], path: Path) -> bool:
    """Analytic σ/√α and σ/√(1−α) with the runs' recorded per-pool σ as points."""
    split = [r for r in runs if r.method.startswith("alpha-split") and r.sigmas]
    sigma = float(split[0].final.get("noise_multiplier", 0.1)) if split else 0.1
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    alpha = np.linspace(0.01, 0.99, 200)
    ax.plot(alpha, sigma / np.sqrt(alpha), color=COLOURS["encoder"], label="encoder pool σ/√α")
    ax.plot(alpha, sigma / np.sqrt(1 - alpha), color=COLOURS["decoder"], label="decoder pool σ/√(1−α)")
    ax.axhline(sigma, color="grey", ls=":", label=f"flat σ = {sigma:g}")
    markers = {}
    for r in split:
        for pool, s in r.sigmas.items():
            colour = pool_colour(pool)
            label = None if pool in markers else f"runs: {pool}"
            markers[pool] = True
            ax.scatter([float(r.final["alpha"])], [s], color=colour, edgecolor="k", zorder=3, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("α (encoder share of C²)")
    ax.set_ylabel("effective noise multiplier σ_k")
    legend_outside(ax)
    return _save(fig, path)


def plot_wer_vs_alpha(runs: Sequence[Run], path: Path) -> bool:
    """WER mean ± std over seeds against α, one line per arch × condition (× grouping)."""
    lines: dict[tuple[str, str, str], dict[float, list[float]]] = defaultdict(
        lambda: defaultdict(list))
    for r in runs:
        if r.method.startswith("alpha-split"):
            lines[(r.arch, r.condition, r.grouping)][float(r.final["alpha"])].append(r.wer)
    if not lines:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((arch, cond, grouping), points) in enumerate(sorted(lines.items())):
        c = colours[i % len(colours)]
        xs = sorted(points)
        means = [np.mean(points[a]) for a in xs]
        stds = [np.std(points[a], ddof=1) if len(points[a]) > 1 else 0.0 for a in xs]
        per_layer = " per-layer" if grouping == "layer" else ""
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, color=c,
                    label=f"{arch} {cond}{per_layer}")
        flat = [r.wer for r in runs if r.method == "flat" and (r.arch, r.condition) == (arch, cond)]
        if flat:
            ax.axhline(float(np.mean(flat)), color=c, ls="--", lw=1, label=f"flat ({arch} {cond})")
    ax.set_xscale("log")
    ax.set_xlabel("α (encoder share of C²)")
    ax.set_ylabel("WER")
    legend_outside(ax)
    return _save(fig, path)


def plot_wer_by_method(runs: Sequence[Run], path: Path) -> bool:
    """Bars of mean WER per method with the table's CI, the seeds as dots, one panel per
    arch × condition."""
    from cluster_fl.report.results import method_key
    from cluster_fl.report.table import summarise

    cells = [c for c in summarise(runs, resamples=1000) if c.method != "round-0"]
    if not cells:
        return False
    start = {(c.arch, c.condition): c.mean for c in summarise(
        [r for r in runs if r.method == "round-0"], resamples=10)}
    panels = list(dict.fromkeys((c.arch, c.condition) for c in cells))
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False,
                             sharey=True)
    for ax, (arch, cond) in zip(axes[0], panels):
        mine = sorted([c for c in cells if (c.arch, c.condition) == (arch, cond)],
                      key=lambda c: method_key(c.method))
        x = np.arange(len(mine))
        means = np.array([c.mean for c in mine])
        low = np.array([c.ci_low if math.isfinite(c.ci_low) else c.mean for c in mine])
        high = np.array([c.ci_high if math.isfinite(c.ci_high) else c.mean for c in mine])
        ax.bar(x, means, color="#c7d7e8", edgecolor="k", width=0.7)
        ax.errorbar(x, means, yerr=[np.maximum(means - low, 0), np.maximum(high - means, 0)],
                    fmt="none", ecolor="k",
                    capsize=4, label="95% CI (seeds and speakers)")
        for i, c in enumerate(mine):
            ax.scatter(np.full(c.n, i) + np.linspace(-0.15, 0.15, c.n), [r.wer for r in c.runs],
                       s=12, color="tab:red", zorder=3, label="seeds" if i == 0 else None)
        if (arch, cond) in start:
            ax.axhline(start[(arch, cond)], color="grey", ls=":",
                       label="starting model (round 0)")
        ax.set_xticks(x)
        ax.set_xticklabels([f"{c.method}\n(n={c.n})" for c in mine], rotation=45, ha="right",
                           fontsize=7)
        ax.set_title(f"{arch} · {cond}", fontsize=9)
    legend_outside(axes[0][-1], fontsize=6)  # one legend, right of the last panel
    axes[0][0].set_ylabel("WER")
    tops = [c.ci_high for c in cells if math.isfinite(c.ci_high)] + [c.mean for c in cells]
    axes[0][0].set_ylim(0, 1.3 * max(tops + list(start.values())))  # headroom for the legend
    return _save(fig, path)


def plot_clip_rates(runs: Sequence[Run], title: str, path: Path) -> bool:
    """Per round, mean over seeds, one line per DP method: the fraction of clients clipped (left)
    and the fraction of each pool's update norm that survives clipping (``retained/<pool>``,
    right; one line per method × pool), which still tells methods apart when C binds for every
    client and the clip rate is 1 throughout."""
    by_method = defaultdict(list)
    for r in runs:
        if r.rounds and any(row.get("clip_rate") is not None for row in r.rounds) \
                and r.method not in ("fedavg", "round-0"):
            by_method[r.method].append(r)
    if not by_method:
        return False
    from cluster_fl.report.results import method_key

    plt = _plt()
    fig, (ax, ax_kept) = plt.subplots(1, 2, figsize=(11, 4))
    every_pool = sorted({k.split("/", 1)[1] for rs in by_method.values() for r in rs
                         for row in r.rounds for k in row if k.startswith("retained/")})
    for i, method in enumerate(sorted(by_method, key=method_key)):
        rs = by_method[method]
        ax.plot(*_per_round(rs, "clip_rate"), marker=".", label=method)
        pools = sorted({k.split("/", 1)[1] for r in rs for row in r.rounds for k in row
                        if k.startswith("retained/")})
        for pool in pools:  # the pool's colour, the method's line style
            ax_kept.plot(*_per_round(rs, f"retained/{pool}"), marker=".",
                         ls=METHOD_STYLES[i % len(METHOD_STYLES)],
                         color=pool_colour(pool, every_pool),
                         label=method if pools == ["all"] else f"{method} · {pool}")
    ax.set_ylim(-0.02, 1.05)
    ax.set_ylabel("clients clipped (any pool/group)")
    ax_kept.set_ylim(0, 1.05)
    ax_kept.set_ylabel("retained update norm (clipped / raw, per pool)")
    for a in (ax, ax_kept):
        a.set_xlabel("round")
        a.xaxis.get_major_locator().set_params(integer=True)
        legend_outside(a, fontsize=6)
    fig.suptitle(title + _noise_note([r for rs in by_method.values() for r in rs]), fontsize=9)
    return _save(fig, path)


def plot_wer_by_round(runs: Sequence[Run], title: str, path: Path) -> bool:
    """Test WER against round, one line per method (mean over seeds), where runs were evaluated
    during training; each line ends at the final evaluation (round R) and the starting model,
    where scored, is round 0. False when no run evaluated before its last round."""
    from cluster_fl.report.results import method_key

    by_method = defaultdict(list)
    for r in runs:
        by_method[r.method].append(r)
    if not any(row.get("wer") is not None for r in runs for row in r.rounds):
        return False
    start = [r.wer for r in by_method.pop("round-0", [])]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for method in sorted(by_method, key=method_key):
        rs = by_method[method]
        points: dict[int, list[float]] = defaultdict(list)
        for r in rs:
            for row in r.rounds:
                if row.get("wer") is not None:
                    points[int(row["round"])].append(float(row["wer"]))
            last = max((int(row["round"]) for row in r.rounds), default=None)
            if last is not None and math.isfinite(r.wer):
                points[last].append(r.wer)  # the final evaluation
        if start:
            points[0] = list(start)
        xs = sorted(points)
        ax.plot(xs, [float(np.mean(points[x])) for x in xs], marker="o", label=method)
    ax.set_xlabel("round")
    ax.set_ylabel("test WER (mean over seeds)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title, fontsize=9)
    legend_outside(ax)
    return _save(fig, path)


def make_figures(runs: Sequence[Run], out: Path) -> list[Path]:
    """Every figure the runs support; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def keep(ok: bool, path: Path) -> None:
        if ok:
            written.append(path)

    for (arch, cond, method), rs in sorted(_cells(runs).items()):
        title = f"{arch} · {cond} encoder · {method} ({len(rs)} seeds)"
        slug = _slug(f"{arch}__{cond}__{method}")
        keep(plot_norms(rs, title, out / f"norms__{slug}.png"), out / f"norms__{slug}.png")
        if method == "flat":
            p = out / f"flat_dynamics__{_slug(arch + '__' + cond)}.png"
            keep(plot_flat_dynamics(rs, f"flat DP · {arch} · {cond} encoder", p), p)
        keep(plot_pools(rs, title, out / f"pools__{slug}.png"), out / f"pools__{slug}.png")
    for arch, cond in dict.fromkeys((r.arch, r.condition) for r in runs):
        p = out / f"clip_rates__{_slug(arch + '__' + cond)}.png"
        keep(plot_clip_rates([r for r in runs if (r.arch, r.condition) == (arch, cond)],
                             f"clip rates · {arch} · {cond}", p), p)
        p = out / f"wer_by_round__{_slug(arch + '__' + cond)}.png"
        keep(plot_wer_by_round([r for r in runs if (r.arch, r.condition) == (arch, cond)],
                               f"test WER by round · {arch} · {cond}", p), p)
    keep(plot_wer_by_method(runs, out / "wer_by_method.png"), out / "wer_by_method.png")
    keep(plot_sigma_vs_alpha(runs, out / "sigma_vs_alpha.png"), out / "sigma_vs_alpha.png")
    keep(plot_wer_vs_alpha(runs, out / "wer_vs_alpha.png"), out / "wer_vs_alpha.png")
    return written
