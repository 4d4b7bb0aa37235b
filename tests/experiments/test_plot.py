"""`cluster-fl plot`: every figure is written, non-empty, from crafted run folders."""

import math

import pytest

from cluster_fl.cli import main
from cluster_fl.experiments.plot import noise_floor
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
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert len(capsys.readouterr().out.splitlines()) == len(names)


def test_plot_without_runs_is_a_user_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "f")]) == 2
