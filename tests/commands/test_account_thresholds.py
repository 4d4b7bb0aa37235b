"""``cluster-fl account`` and ``cluster-fl thresholds`` (cluster_fl/commands/): the JSON contracts of
DESIGN §10 on the example layout preset (tests/privacy/data/layout.yaml), the corpus and model
fallbacks, text output, and user errors (exit 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cluster_fl import cli
from cluster_fl.privacy import compute_epsilon, noise_multiplier_for_epsilon

LAYOUT = str(Path(__file__).resolve().parents[1] / "privacy" / "data" / "layout.yaml")


def run_json(capsys, *argv):
    rc = cli.main(list(argv) + ["--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_thresholds_json_contract(capsys):
    r = run_json(capsys, "thresholds", LAYOUT)
    assert {"total_budget", "groups", "pools"} <= set(r)
    assert r["total_budget"] == 1.0
    for g in r["groups"]:
        assert {"name", "component", "numel", "pool", "threshold"} <= set(g)
    for p in r["pools"]:
        assert {"name", "share", "effective_noise_multiplier"} <= set(p)
    assert math.fsum(g["threshold"] ** 2 for g in r["groups"]) == pytest.approx(1.0, rel=1e-9)
    sig = {p["name"]: round(p["effective_noise_multiplier"], 4) for p in r["pools"]}
    assert sig == {"encoder": 0.4472, "decoder": 0.1026}
    pools = {g["pool"] for g in r["groups"] if g["component"] == "connector"}
    assert pools == {"decoder"}
    assert len(r["groups"]) == 6 * 6 + 2 + 22 * 6


def test_thresholds_frozen_encoder_and_overrides(capsys):
    r = run_json(capsys, "thresholds", LAYOUT, "model.freeze_encoder=true",
                 "privacy.inside_pool=uniform", "privacy.clip_norm=2.0")
    assert [p["name"] for p in r["pools"]] == ["decoder"]
    assert r["pools"][0]["share"] == 1.0
    assert r["pools"][0]["effective_noise_multiplier"] == pytest.approx(0.1)
    assert len({round(g["threshold"], 12) for g in r["groups"]}) == 1
    assert math.fsum(g["threshold"] ** 2 for g in r["groups"]) == pytest.approx(4.0, rel=1e-9)
    assert any("freeze_encoder" in n for n in r["notes"])


def test_account_json_contract_matches_accounting(capsys):
    r = run_json(capsys, "account", LAYOUT, "privacy.noise_multiplier=1.0")
    for key in ("accountant", "epsilon", "delta", "noise_multiplier", "sampling_rate", "rounds",
                "events"):
        assert key in r
    assert r["sampling_rate"] == 16 / 1000 and r["rounds"] == 30 and r["accountant"] == "rdp"
    # the round engine's noised diagnostics (privacy.diagnostics_noise_multiplier, default 5)
    # are a second Gaussian release per round, composed with the update
    z_d = r["diagnostics_noise_multiplier"]
    assert z_d == 5.0
    assert r["epsilon"] == pytest.approx(
        compute_epsilon(1.0, 0.016, 30, 1e-5, statistic_noise_multiplier=z_d), rel=1e-12)
    assert r["epsilon"] > compute_epsilon(1.0, 0.016, 30, 1e-5)
    # research mode (the default) is a simulation: the mechanism's ε, the seed on record;
    # secure mode the same ε, valid
    assert r["guarantee"] == "simulation" and "seed" in r["guarantee_note"]
    secure = run_json(capsys, "account", LAYOUT, "privacy.noise_multiplier=1.0",
                      "privacy.secure_mode=true")
    assert secure["guarantee"] == "valid" and secure["epsilon"] == r["epsilon"]
    exact = run_json(capsys, "account", LAYOUT, "privacy.diagnostics=exact")
    assert exact["guarantee"] == "void" and exact["epsilon"] is None


def test_account_target_epsilon_and_adaptive_cost(capsys):
    r = run_json(capsys, "account", LAYOUT, "privacy.target_epsilon=2.0")
    sigma = r["noise_multiplier_for_target"]
    assert sigma == pytest.approx(noise_multiplier_for_epsilon(
        2.0, 0.016, 30, 1e-5, statistic_noise_multiplier=5.0), rel=1e-9)
    static = run_json(capsys, "account", LAYOUT, "privacy.noise_multiplier=1.0")
    ema = run_json(capsys, "account", LAYOUT, "privacy.noise_multiplier=1.0",
                   "privacy.clipping=size-ema")
    assert ema["epsilon"] > static["epsilon"]
    # the adaptive statistic (z_s = 1) and the diagnostics (z_d = 5) fold into one multiplier
    assert ema["events"][0]["statistic_noise_multiplier"] == pytest.approx((1 + 5.0 ** -2) ** -0.5)
    void = run_json(capsys, "account", LAYOUT, "privacy.clipping=quantile",
                    "privacy.adaptive_private=false")
    assert void["guarantee"] == "void" and void["epsilon"] is None


def test_account_mechanism_none(capsys):
    r = run_json(capsys, "account", LAYOUT, "privacy.mechanism=none")
    assert r["guarantee"] == "none" and r["epsilon"] is None


def test_text_output(capsys):
    assert cli.main(["account", LAYOUT]) == 0
    out = capsys.readouterr().out
    assert "epsilon" in out and "[guarantee: simulation]" in out and "regenerates" in out
    assert cli.main(["thresholds", LAYOUT]) == 0
    out = capsys.readouterr().out
    assert "0.4472" in out and "0.1026" in out


def test_account_without_population_or_corpus_is_a_user_error(capsys, tmp_path):
    rc = cli.main(["account", LAYOUT, "privacy.population=0",
                   f"data.corpus={tmp_path / 'no_such_corpus'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "privacy.population" in err


def test_account_counts_clients_of_a_corpus(capsys, tiny_corpus):
    from cluster_fl.config import load_config
    from cluster_fl.data import count_clients

    n = count_clients(load_config(LAYOUT, [f"data.corpus={tiny_corpus}"]).data)
    assert n > 2
    r = run_json(capsys, "account", LAYOUT, "privacy.population=0", f"data.corpus={tiny_corpus}",
                 "fl.clients_per_round=2")
    assert r["population"] == n and r["sampling_rate"] == 2 / n


def test_thresholds_without_layout_reads_the_models_groups(capsys):
    from cluster_fl.config import load_config
    from cluster_fl.models import describe_groups

    overrides = ["model.layout=null", "model.arch=whisper-tinyllama-tiny"]
    r = run_json(capsys, "thresholds", LAYOUT, *overrides)
    expected = list(describe_groups(load_config(LAYOUT, overrides).model))
    assert [(g["name"], g["component"], g["numel"]) for g in r["groups"]] == \
        [(g.name, g.component, g.numel) for g in expected]
    assert {g["component"] for g in r["groups"]} == {"encoder", "connector", "decoder"}
    assert math.fsum(g["threshold"] ** 2 for g in r["groups"]) == pytest.approx(1.0, rel=1e-9)
    assert {p["name"] for p in r["pools"]} == {"encoder", "decoder"}


def test_cohort_larger_than_population_is_a_user_error(capsys):
    rc = cli.main(["account", LAYOUT, "privacy.population=4"])
    err = capsys.readouterr().err
    assert rc == 2 and "clients_per_round" in err and len(err.strip().splitlines()) == 1


def test_unreachable_target_still_reports_epsilon(capsys):
    # fixed-size sampling doubles the sensitivity; z_s = 0.3 alone already costs more than ε = 1
    r = run_json(capsys, "account", LAYOUT, "privacy.clipping=size-ema", "fl.sampling=fixed",
                 "privacy.stat_noise_multiplier=0.3", "privacy.target_epsilon=1.0")
    assert r["epsilon"] > 1.0 and r["noise_multiplier_for_target"] is None
    assert "unreachable" in r["target_note"]
