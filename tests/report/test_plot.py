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
