"""`cluster-fl plot`: every figure is written, non-empty, from crafted run folders."""

import math

import pytest

from cluster_fl.cli import main
from cluster_fl.report.plot import noise_floor
from fakes import write_run


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    for seed in (0, 1):
        write_run(root / f"flat{seed}", method="flat", seed=seed, wer=0.2 + 0.01 * seed)
        for alpha in (0.05, 0.2):
            write_run(root / f"split{alpha}_{seed}", method="alpha-split", alpha=alpha, seed=seed,
                      wer=0.22 + alpha / 10 + 0.01 * seed, pools=("encoder", "decoder"))
    return root


def test_noise_floor_is_sigma_c_sqrt_p_over_n():
    assert noise_floor(0.1, 1.0, 400, 94) == pytest.approx(0.1 * 20 / 94)
    assert math.isclose(noise_floor(0.1, 2.0, 1, 1), 0.2)


def test_plot_writes_every_figure(results, tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["plot", str(results), "--out", str(out)]) == 0
    names = {p.name for p in out.glob("*.png")}
    assert "sigma_vs_alpha.png" in names and "wer_vs_alpha.png" in names
    assert "flat_dynamics__whisper-tinyllama-tiny__unfrozen.png" in names
    assert sum(n.startswith("norms__") for n in names) == 3  # flat + two alpha values
    assert sum(n.startswith("pools__") for n in names) == 2  # only multi-pool runs
    assert "wer_by_method.png" in names
    assert "clip_rates__whisper-tinyllama-tiny__unfrozen.png" in names
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert len(capsys.readouterr().out.splitlines()) == len(names)


def test_plot_without_runs_is_a_user_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "f")]) == 2


def test_wer_by_method_shows_the_table_cells_and_the_clip_rate_lines(results, tmp_path):
    """The bar figure draws one bar per cell at the WER table's mean, whiskers at its CI; the
    clip-rate figure one line per DP method with the runs' per-round means."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from cluster_fl.report import plot as P
    from cluster_fl.report.results import find_runs
    from cluster_fl.report.table import summarise

    runs = find_runs([results])
    captured = {}
    real_save = P._save
    P._save = lambda fig, path: captured.setdefault(path.name, fig) is not None
    try:
        assert P.plot_wer_by_method(runs, tmp_path / "w.png")
        assert P.plot_clip_rates(runs, "t", tmp_path / "c.png")
    finally:
        P._save = real_save
    bars = [p.get_height() for p in captured["w.png"].axes[0].patches]
    means = sorted(c.mean for c in summarise(runs, resamples=10))
    assert sorted(bars) == pytest.approx(means)
    lines = {ln.get_label(): ln.get_ydata() for ln in captured["c.png"].axes[0].get_lines()}
    assert set(lines) == {"flat", "alpha-split α=0.05", "alpha-split α=0.2"}
    assert list(lines["flat"]) == pytest.approx([0.9 / r for r in (1, 2, 3)])
    # beside it, how much of each pool's update norm survives clipping: informative where the
    # clip rate is 1 every round (C binds for every client, as in the study)
    retained = {ln.get_label(): ln.get_ydata() for ln in captured["c.png"].axes[1].get_lines()}
    assert set(retained) == {"flat", "alpha-split α=0.05 · encoder", "alpha-split α=0.05 · decoder",
                             "alpha-split α=0.2 · encoder", "alpha-split α=0.2 · decoder"}
    assert list(retained["alpha-split α=0.2 · decoder"]) == pytest.approx([0.6, 0.7, 0.8])
    plt.close("all")


def _capture(P):
    captured = {}
    real = P._save

    def keep(fig, path):  # lay out as _save does, keep the figure
        fig.tight_layout()
        return captured.setdefault(path.name, fig) is not None
    P._save = keep
    return captured, real


def _with_round_wer(root, seeds=(0, 1)):
    """Runs evaluated every round before the last (eval.every = 1 of 3 rounds)."""
    import pyarrow.parquet as pq

    from fakes import write_table

    for method, base in (("flat", 0.5), ("uniform", 0.8)):
        for seed in seeds:
            folder = write_run(root / f"{method}{seed}", method=method, seed=seed,
                               wer=base - 0.2 + 0.01 * seed)
            rows = pq.read_table(folder / "rounds.parquet").to_pylist()
            for row in rows[:-1]:
                row["wer"] = base - 0.1 * row["round"] + 0.01 * seed
            write_table(folder / "rounds.parquet", rows)
    write_run(root / "start", method="round-0", wer=0.99, rounds=0)
    return root


def test_wer_by_round_draws_each_method_from_round_0_to_the_final_evaluation(tmp_path):
    from cluster_fl.report import plot as P
    from cluster_fl.report.results import find_runs

    runs = find_runs([_with_round_wer(tmp_path / "r")])
    captured, real = _capture(P)
    try:
        assert P.plot_wer_by_round(runs, "t", tmp_path / "wr.png")
    finally:
        P._save = real
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
             for ln in captured["wr.png"].axes[0].get_lines()}
    assert set(lines) == {"flat", "uniform"}
    xs, ys = lines["flat"]
    assert xs == [0, 1, 2, 3]  # round-0, two evaluated rounds, the final evaluation at round 3
    assert ys == pytest.approx([0.99, 0.405, 0.305, 0.305])
    assert main(["plot", str(tmp_path / "r"), "--out", str(tmp_path / "f")]) == 0
    assert (tmp_path / "f" / "wer_by_round__whisper-tinyllama-tiny__unfrozen.png").is_file()


def test_no_wer_by_round_without_evaluations_during_training(results, tmp_path):
    from cluster_fl.report import plot as P
    from cluster_fl.report.results import find_runs

    assert not P.plot_wer_by_round(find_runs([results]), "t", tmp_path / "x.png")


def test_no_legend_covers_a_plotting_area(results, tmp_path):
    from matplotlib import pyplot as plt

    from cluster_fl.report import plot as P
    from cluster_fl.report.results import find_runs

    runs = find_runs([results]) + find_runs([_with_round_wer(tmp_path / "r")])
    captured, real = _capture(P)
    try:
        P.make_figures(runs, tmp_path / "figs")
    finally:
        P._save = real
    assert len(captured) >= 8
    checked = 0
    for name, fig in captured.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        areas = [ax.get_window_extent(renderer) for ax in fig.axes]
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            box = legend.get_window_extent(renderer)
            checked += 1
            for area in areas:
                assert not box.overlaps(area), (name, ax.get_ylabel())
    assert checked >= len(captured)  # every figure has a legend, and none is over an axes
    plt.close("all")


def test_one_colour_per_pool_across_figures():
    from cluster_fl.report.plot import COLOURS, pool_colour

    names = ["all", "encoder", "connector", "decoder", "vision", "audio", "text"]
    colours = [pool_colour(n, names) for n in names]
    assert len(set(colours)) == len(names)
    assert pool_colour("encoder") == COLOURS["encoder"] == pool_colour("encoder", ["x", "y"])
    assert pool_colour("audio", ["audio", "text"]) != pool_colour("text", ["audio", "text"])
