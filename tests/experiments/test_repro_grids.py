"""The study's grids (issue 14 item 3): repro-heavy and repro-mild parse and expand to
8 methods (heavy: and an alpha sweep) x 3 seeds in their regime, with the paper's σ and
per-layer grouping."""

from pathlib import Path

import pytest

from cluster_fl.experiments.gridspec import expand, load_grid

REPO = Path(__file__).resolve().parents[2]
# the findings' methods first, so a study cut short still has them; heavy adds an alpha sweep
METHODS = {"heavy": ["fedavg", "flat", "uniform", "alpha-split", "uniform-ema", "size-ema", "size",
                     "pools-3", "alpha-split-matrix", "alpha-split-0.03", "alpha-split-0.5"],
           "mild": ["flat", "alpha-split", "size-ema", "uniform", "fedavg", "uniform-ema", "size",
                    "pools-3"]}


@pytest.mark.parametrize("regime, encoder_lr_mult", [("heavy", 0.1), ("mild", 1.0)])
def test_repro_grid_parses_and_expands_to_every_method_and_seed(regime, encoder_lr_mult):
    path = REPO / "configs" / "grids" / f"repro-{regime}.yaml"
    grid = load_grid(path)
    specs = expand(grid)
    assert len(specs) == len(METHODS[regime]) * 3
    assert len({s.run_id for s in specs}) == len(specs)
    assert grid.experiment == f"repro-{regime}" and grid.seeds == (0, 1, 2)
    assert [s.axes["method"] for s in specs[::3]] == METHODS[regime]
    for s in specs:
        cfg = s.config
        assert s.axes["condition"] == regime and not cfg.model.freeze_encoder
        assert cfg.client.lr_encoder_mult == encoder_lr_mult
        assert cfg.privacy.noise_multiplier == 0.1
        assert cfg.privacy.grouping == ("matrix" if s.axes["method"].endswith("-matrix") else "layer")
        assert cfg.model.arch == "whisper-tinyllama-tiny" and cfg.run.device == "cpu"
        # the starting point of item 1: a pretrained model whose connector FL has to learn
        assert cfg.model.connector_init == "fresh" and cfg.model.checkpoint.endswith("repro-joint5")
    by_method = {s.axes["method"]: s.config.privacy for s in specs if s.seed == 0}
    assert by_method["fedavg"].mechanism == "none"
    assert all(p.mechanism == "gaussian" for m, p in by_method.items() if m != "fedavg")
    assert by_method["alpha-split"].clipping == "alpha-split"
    for name, p in by_method.items():  # the sweep's alphas are in their names
        if name.startswith("alpha-split-") and not name.endswith("-matrix"):
            assert p.clipping == "alpha-split" and p.alpha == float(name.split("-")[-1])
    pools = by_method["pools-3"]
    assert pools.clipping == "pools"
    assert [(p["name"], tuple(p["components"])) for p in pools.pools] == [
        ("encoder", ("encoder",)), ("connector", ("connector",)), ("decoder", ("decoder",))]
    # calibrate's alpha for the regime: small where the encoder's updates are small
    assert by_method["alpha-split"].alpha == {"heavy": 0.1282, "mild": 0.5}[regime]
    assert pools.pools[0]["share"] == pytest.approx(round(by_method["alpha-split"].alpha, 3))
    assert sum(p["share"] for p in pools.pools) == pytest.approx(1.0)
    text = path.read_text()  # where each sized value came from stays written beside it
    assert "PILOT" in text and "CALIBRATE" in text


def test_the_private_grid_is_heavy_flat_uniform_alpha_at_epsilon_at_most_10():
    """Item 5: the grid ready to launch -- its sigma, cohort and rounds give epsilon <= 10 at
    delta 1e-5 over the 2,400-speaker population it names (accounted here without the corpus)."""
    from cluster_fl.commands.account import account_report
    from cluster_fl.config import replace

    specs = expand(load_grid(REPO / "configs" / "grids" / "repro-private.yaml"))
    assert [s.axes["method"] for s in specs[::3]] == ["flat", "uniform", "alpha-split"]
    heavy = {s.config.client.lr_encoder_mult for s in specs}
    assert heavy == {0.1} and {s.config.model.connector_init for s in specs} == {"fresh"}
    cfg = replace(specs[0].config, {"privacy.population": 2400})
    report = account_report(cfg)
    # a research-mode grid: the mechanism's ε, recorded as a simulation (issue 28)
    assert report["guarantee"] == "simulation" and report["delta"] == 1e-5
    assert report["sampling_rate"] == pytest.approx(0.1)
    assert 9.0 < report["epsilon"] <= 10.0
    assert report["noise_multiplier_for_target"] <= cfg.privacy.noise_multiplier
