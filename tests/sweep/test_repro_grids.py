"""The pre-registered study's grids (results/repro/PROTOCOL.md): repro-heavy and
repro-mild parse and expand to the protocol's 9 methods x 5 seeds in their regime -- flat,
alpha-split at the paper's alpha and at calibrate's, uniform, size, size-EMA, uniform-EMA, 3 pools
and FedAvg -- with the paper's sigma, per-layer grouping, every test utterance and the
step-budgeted starting model; the LR sweep gives every method the same values on tuning seeds."""

from pathlib import Path

import pytest

from cluster_fl.sweep.gridspec import expand, load_grid

REPO = Path(__file__).resolve().parents[2]
# the findings' methods first, so a study cut short still has them
METHODS = {"heavy": ["fedavg", "flat", "uniform", "alpha-split-paper", "alpha-split-calibrated",
                     "size-ema", "size", "uniform-ema", "pools-3"],
           "mild": ["flat", "alpha-split-paper", "alpha-split-calibrated", "size-ema", "uniform",
                    "fedavg", "uniform-ema", "size", "pools-3"]}
SEEDS = (0, 1, 2, 3, 4)
CHECKPOINT = "repro-joint-5600steps"  # configs/pretrain-repro.yaml's out


@pytest.mark.parametrize("regime, encoder_lr_mult", [("heavy", 0.1), ("mild", 1.0)])
def test_repro_grid_parses_and_expands_to_every_method_and_seed(regime, encoder_lr_mult):
    path = REPO / "configs" / "grids" / f"repro-{regime}.yaml"
    grid = load_grid(path)
    specs = expand(grid)
    assert len(specs) == len(METHODS[regime]) * len(SEEDS)
    assert len({s.run_id for s in specs}) == len(specs)
    # a new experiment: the first study's finished folders (repro-*) are never taken as done
    assert grid.experiment == f"prereg-{regime}" and grid.seeds == SEEDS
    assert [s.axes["method"] for s in specs[::len(SEEDS)]] == METHODS[regime]
    for s in specs:
        cfg = s.config
        assert s.axes["condition"] == regime and not cfg.model.freeze_encoder
        assert cfg.client.lr_encoder_mult == encoder_lr_mult
        assert cfg.privacy.noise_multiplier == 0.1 and cfg.privacy.grouping == "layer"
        assert cfg.model.arch == "whisper-tinyllama-tiny" and cfg.run.device == "cpu"
        assert cfg.eval.max_utterances == 0  # every test speaker, every utterance
        # the starting point: the step-budgeted checkpoint, a fresh connector drawn per seed
        assert cfg.model.connector_init == "fresh" and cfg.model.connector_seed is None
        assert cfg.model.checkpoint.endswith(CHECKPOINT)
        # the pilot's picks (PROTOCOL.md §7): 40 rounds, q = 0.1 of the 240 private speakers
        assert cfg.fl.rounds == 40 and cfg.fl.clients_per_round == 24
    by_method = {s.axes["method"]: s.config.privacy for s in specs if s.seed == 0}
    assert by_method["fedavg"].mechanism == "none"
    assert all(p.mechanism == "gaussian" for m, p in by_method.items() if m != "fedavg")
    assert by_method["alpha-split-paper"].alpha == 0.05  # the paper's
    calibrated = by_method["alpha-split-calibrated"]
    assert calibrated.clipping == "alpha-split"
    # calibrate's alpha for the regime on the starting model (PROTOCOL.md §3): small where the
    # encoder's updates are small, the clamp where they are not
    assert calibrated.alpha == {"heavy": 0.03049, "mild": 0.5}[regime]
    pools = by_method["pools-3"]
    assert pools.clipping == "pools"
    assert [(p["name"], tuple(p["components"])) for p in pools.pools] == [
        ("encoder", ("encoder",)), ("connector", ("connector",)), ("decoder", ("decoder",))]
    assert pools.pools[0]["share"] == pytest.approx(calibrated.alpha)
    assert abs(sum(p["share"] for p in pools.pools) - 1.0) < 1e-9  # as the config demands
    text = path.read_text()  # where each sized value came from stays written beside it
    assert "PROTOCOL" in text


def test_the_lr_sweep_gives_every_method_the_same_values_on_tuning_seeds():
    grid = load_grid(REPO / "configs" / "grids" / "repro-lr-sweep.yaml")
    specs = expand(grid)
    assert not set(grid.seeds) & set(SEEDS)  # tuning seeds are never study seeds
    values: dict[tuple[str, str], set[float]] = {}
    for s in specs:
        method = s.axes["method"].removesuffix("-heavy").removesuffix("-mild")
        values.setdefault((s.axes["condition"], method), set()).add(s.config.fl.lr)
    assert {m for _, m in values} == set(METHODS["heavy"])
    assert len({frozenset(v) for v in values.values()}) == 1 and len(next(iter(values.values()))) >= 3
    # 1e-3, 3e-3, 1e-2 and, by the bracketing rule (heavy flat picked the lowest), 3e-4
    assert next(iter(values.values())) == {0.0003, 0.001, 0.003, 0.01}
    assert len(specs) == 2 * len(METHODS["heavy"]) * 4 * len(grid.seeds)
    # each regime's calibrated alpha and pools are those of its study grid
    for regime in ("heavy", "mild"):
        study = {s.axes["method"]: s.config.privacy for s in expand(load_grid(
            REPO / "configs" / "grids" / f"repro-{regime}.yaml")) if s.seed == 0}
        sweep = {s.axes["method"].removesuffix(f"-{regime}"): s.config.privacy for s in specs
                 if s.axes["condition"] == regime and s.seed == grid.seeds[0]
                 and s.config.fl.lr == specs[0].config.fl.lr}
        assert sweep["alpha-split-calibrated"].alpha == study["alpha-split-calibrated"].alpha
        assert sweep["pools-3"].pools == study["pools-3"].pools


def test_the_private_grid_is_heavy_flat_uniform_alpha_at_epsilon_at_most_10():
    """Item 5: the grid ready to launch -- its sigma, cohort and rounds give epsilon <= 10 at
    delta 1e-5 over the 2,400-speaker population it names (accounted here without the corpus)."""
    from cluster_fl.commands.account import account_report
    from cluster_fl.config import override

    specs = expand(load_grid(REPO / "configs" / "grids" / "repro-private.yaml"))
    assert [s.axes["method"] for s in specs[::3]] == ["flat", "uniform", "alpha-split"]
    heavy = {s.config.client.lr_encoder_mult for s in specs}
    assert heavy == {0.1} and {s.config.model.connector_init for s in specs} == {"fresh"}
    cfg = override(specs[0].config, {"privacy.population": 2400})
    report = account_report(cfg)
    # a research-mode grid: the mechanism's ε, recorded as a simulation
    assert report["guarantee"] == "simulation" and report["delta"] == 1e-5
    assert report["sampling_rate"] == pytest.approx(0.1)
    assert 9.0 < report["epsilon"] <= 10.0
    assert report["noise_multiplier_for_target"] <= cfg.privacy.noise_multiplier


def test_the_eurollm_grid_is_the_heavy_grid_on_the_third_architecture():
    """Item 6 (PROTOCOL.md §13): whisper-eurollm-tiny from its own step-budgeted checkpoint, the
    heavy regime's settings, flat / uniform / alpha-split / size-EMA / FedAvg on 3 seeds."""
    specs = expand(load_grid(REPO / "configs" / "grids" / "repro-eurollm.yaml"))
    heavy = {s.axes["method"]: s.config for s in expand(load_grid(
        REPO / "configs" / "grids" / "repro-heavy.yaml")) if s.seed == 0}
    assert [s.axes["method"] for s in specs[::3]] == [
        "flat", "uniform", "alpha-split-calibrated", "size-ema", "fedavg"]
    assert {s.seed for s in specs} == {0, 1, 2}
    for s in specs:
        cfg, ref = s.config, heavy[s.axes["method"]]
        assert cfg.model.arch == "whisper-eurollm-tiny"
        assert cfg.model.checkpoint.endswith("repro-eurollm-joint-5600steps")
        # everything but the architecture and its checkpoint is the heavy grid's cell
        assert (cfg.fl, cfg.client, cfg.eval, cfg.data) == (ref.fl, ref.client, ref.eval, ref.data)
        assert cfg.privacy.clipping == ref.privacy.clipping
        assert cfg.privacy.noise_multiplier == ref.privacy.noise_multiplier


@pytest.mark.parametrize("regime", ["heavy", "mild"])
def test_the_sweep_tuned_the_study_cells_themselves(regime):
    """PROTOCOL.md §8: a sweep cell is its study cell but for the seed and the LR -- a setting
    changed in one grid and not the other (C, rounds, the cohort, alpha, the pools...) would
    give a method an LR tuned for something else. Every sweep LR of every method, compared
    key by key with the study cell of seed 0 at that LR."""
    from cluster_fl.config import override

    sweep = expand(load_grid(REPO / "configs" / "grids" / "repro-lr-sweep.yaml"))
    study = {s.axes["method"]: s.config for s in expand(load_grid(
        REPO / "configs" / "grids" / f"repro-{regime}.yaml")) if s.seed == 0}
    tuned = [s for s in sweep if s.axes["condition"] == regime]
    assert {s.axes["method"].removesuffix(f"-{regime}") for s in tuned} == set(study)
    for s in tuned:
        ref = override(study[s.axes["method"].removesuffix(f"-{regime}")], {
            "fl.lr": s.config.fl.lr, "run.seed": s.seed,
            "run.experiment": s.config.run.experiment, "run.run_id": s.config.run.run_id})
        assert s.config == ref, s.config.run.run_id


PICKS = REPO / "results" / "repro" / "lr-sweep" / "picks.csv"
TIE = 0.005  # PROTOCOL.md §8: ties within 0.005 WER go to the smaller LR


def _picks() -> list[dict[str, str]]:
    import csv

    if not PICKS.exists():
        pytest.skip(f"{PICKS.relative_to(REPO)} not committed yet (the LR sweep is running)")
    return list(csv.DictReader(PICKS.open()))


def test_each_pick_is_the_rule_applied_to_its_sweep_row():
    """PROTOCOL.md §8's rule on the committed numbers: among a (regime, method)'s four sweep LRs,
    the smallest whose WER is within 0.005 of the lowest -- and every method had all four."""
    rows = _picks()
    assert {r["regime"] for r in rows} == {"heavy", "mild"} and len(rows) == 18
    for r in rows:
        cands = sorted((float(lr), float(wer)) for lr, wer in
                       (c.split(":") for c in r["candidates"].split()))
        assert [lr for lr, _ in cands] == [0.0003, 0.001, 0.003, 0.01], r["grid_method"]
        best = min(wer for _, wer in cands)
        assert float(r["lr"]) == next(lr for lr, wer in cands if wer <= best + TIE), r


@pytest.mark.parametrize("grid, regime", [("repro-heavy", "heavy"), ("repro-mild", "mild"),
                                          ("repro-eurollm", "heavy"), ("repro-private", "heavy")])
def test_every_study_cell_runs_at_its_methods_sweep_pick(grid, regime):
    """PROTOCOL.md §8 and §13: a cell's fl.lr is the sweep's pick for its regime and method
    (picks.csv, the sweep's grid names less the regime suffix); the EuroLLM and epsilon <= 10
    grids take the heavy regime's picks (their alpha-split is the heavy calibrated one)."""
    picks = {(r["regime"], r["grid_method"].removesuffix(f"-{r['regime']}")): float(r["lr"])
             for r in _picks()}
    alias = {"alpha-split": "alpha-split-calibrated"}  # repro-private.yaml's name
    for s in expand(load_grid(REPO / "configs" / "grids" / f"{grid}.yaml")):
        method = alias.get(s.axes["method"], s.axes["method"])
        assert s.config.fl.lr == picks[regime, method], (grid, method)
