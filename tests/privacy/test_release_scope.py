"""What a private run may release about its clients beyond the noised update: the
final evaluation is never on the clients' speakers -- refused in secure mode, ``void`` in
research mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster_fl.config import ConfigError, load_config
from cluster_fl.engine.setup import check_eval_speakers
from cluster_fl.errors import UserError
from cluster_fl.privacy import ledger_for


def test_a_secure_run_refuses_to_evaluate_on_the_clients_split():
    with pytest.raises(ConfigError, match="data.eval_split"):
        load_config(None, ["privacy.secure_mode=true", "data.eval_split=private"])
    load_config(None, ["privacy.secure_mode=true", "data.eval_split=test"])  # the default


def test_a_research_run_that_evaluates_on_the_clients_split_is_void():
    cfg = load_config(None, ["data.eval_split=private"])
    ledger = ledger_for(cfg, population=100)
    assert ledger.guarantee == "void"
    assert any("eval" in r for r in ledger.void_reasons)
    assert ledger_for(load_config(None, []), population=100).guarantee == "simulation"


def _clients(*speakers):
    return [SimpleNamespace(speaker=s) for s in speakers]


def _utts(*speakers):
    return [SimpleNamespace(speaker=s) for s in speakers]


def test_evaluation_speakers_that_are_clients_are_refused_in_secure_mode_and_void_otherwise():
    secure = load_config(None, ["privacy.secure_mode=true"])
    research = load_config(None, [])
    with pytest.raises(UserError, match="data.eval_split"):
        check_eval_speakers(secure, _clients("a", "b"), _utts("b", "z"),
                            ledger_for(secure, population=100))
    ledger = ledger_for(research, population=100)
    check_eval_speakers(research, _clients("a", "b"), _utts("b", "z"), ledger)
    assert ledger.guarantee == "void"
    disjoint = ledger_for(secure, population=100)
    check_eval_speakers(secure, _clients("a", "b"), _utts("y", "z"), disjoint)
    assert disjoint.guarantee == "valid"


def test_a_delta_not_below_one_over_n_voids_the_guarantee():
    """δ = 0.5 recorded 'valid': a guarantee with δ ≥ 1/N allows publishing one client's data
    whole with probability δ."""
    secure = load_config(None, ["privacy.secure_mode=true", "privacy.delta=0.5"])
    ledger = ledger_for(secure, population=100)
    assert ledger.guarantee == "void" and any("1/N" in r for r in ledger.void_reasons)
    assert ledger_for(load_config(None, ["privacy.secure_mode=true", "privacy.delta=0.01"]),
                      population=100).guarantee == "void"  # 0.01 = 1/100: not below
    assert ledger_for(load_config(None, ["privacy.secure_mode=true", "privacy.delta=0.009"]),
                      population=100).guarantee == "valid"


def test_epsilon_is_reported_with_its_neighbouring_relation_and_the_noise_tail(capsys):
    """Fixed-size (replace-one) and Poisson (add/remove) ε sat side by side labelled alike, N
    released exactly, the secure sampler's truncation nowhere (items 11 and 12)."""
    from pathlib import Path

    from cluster_fl import cli

    poisson = ledger_for(load_config(None, []), population=100).to_json()
    fixed = ledger_for(load_config(None, ["fl.sampling=fixed"]), population=100).to_json()
    assert "add/remove" in poisson["neighbouring_relation"]
    assert "public" in poisson["neighbouring_relation"]
    assert "replace one" in fixed["neighbouring_relation"]
    assert poisson["noise_tail"] is None  # research mode: numpy's sampler, no claim
    secure = ledger_for(load_config(None, ["privacy.secure_mode=true"]), population=100)
    assert "8.57" in secure.to_json()["noise_tail"]
    layout = str(Path(__file__).resolve().parent / "data" / "layout.yaml")
    assert cli.main(["account", layout, "fl.sampling=fixed"]) == 0
    assert "neighbouring   replace one client" in capsys.readouterr().out
