"""The privacy ledger is written ahead, and its ε is the accountant's for the rounds run.

- A finished run's ε, in privacy.json and in every round's row, is ``compute_epsilon`` for its
  σ, q, the composed statistics (adaptive statistic z_s and noised diagnostics z_d: one Gaussian
  of multiplier (z_s⁻² + z_d⁻²)^-½ beside the update) and T = the rounds run -- also after a
  resume (every resume test compares privacy.json with the uninterrupted run's).
- Round r's charge is on disk (privacy.json, fsync'd) before round r's noise is drawn.
- Killed between a round's charge and its checkpoint (``round:2``: round 2 ran, its checkpoint
  was not written): a research-mode rerun reproduces round 2 bit for bit and is charged once (the
  result equals the uninterrupted run's, ε included); a secure-mode rerun draws round 2's noise
  afresh and is charged again: privacy.json says 4 rounds charged for 3 run, and ε is that of 4,
  above the no-kill run's ε -- the crash cost budget, it leaked none.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from reliability_helpers import (ROUNDS, Driven, assert_identical, cli, config_file, folder_of,
                                 overrides, status)

from cluster_fl.privacy import compute_epsilon
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)


def expected_epsilon(corpus, out, rounds: int, *extra: str, population: int) -> float:
    """ε from the config alone: σ, q = m/N, δ, z_s and z_d composed, T rounds."""
    cfg = resolved_config(None, overrides(corpus, out, *extra))
    p = cfg.privacy
    side = (p.stat_noise_multiplier ** -2 + p.diagnostics_noise_multiplier ** -2) ** -0.5
    return compute_epsilon(p.noise_multiplier, cfg.fl.clients_per_round / population, rounds,
                           p.delta, accountant=p.accountant, sampling=cfg.fl.sampling,
                           statistic_noise_multiplier=side)


def _ledger(folder):
    return json.loads((folder / "privacy.json").read_text())


def test_epsilon_in_privacy_json_and_rows_is_the_accountants_for_the_rounds_run(
        reference, tiny_corpus, tmp_path):
    folder = reference["folder"]
    ledger = _ledger(folder)
    n = ledger["population"]
    assert ledger["rounds"] == ledger["rounds_started"] == ROUNDS
    assert ledger["run_id"] == folder.name and ledger["guarantee"] == "simulation"
    assert ledger["epsilon"] == pytest.approx(
        expected_epsilon(tiny_corpus, tmp_path, ROUNDS, population=n), rel=1e-12)
    for row in reference["rounds"]:  # each round's ε: the accountant's after that many rounds
        assert row["epsilon"] == pytest.approx(
            expected_epsilon(tiny_corpus, tmp_path, row["round"], population=n), rel=1e-12)
    assert reference["final"][0]["epsilon"] == ledger["epsilon"]


def test_a_rounds_charge_is_on_disk_before_its_noise_is_drawn(tiny_corpus, tmp_path,
                                                              monkeypatch):
    from cluster_fl.engine import round as round_mod
    from reliability_helpers import train_in_process

    folder = folder_of(tiny_corpus, tmp_path, "fl.rounds=2")
    seen = []
    add_noise = round_mod.RoundEngine._add_noise

    def spy(self, round_, summer):
        record = _ledger(folder)  # what a crash right now would leave
        seen.append((round_, record["rounds_started"], record["rounds"]))
        return add_noise(self, round_, summer)

    monkeypatch.setattr(round_mod.RoundEngine, "_add_noise", spy)
    train_in_process(tiny_corpus, tmp_path, "fl.rounds=2")
    assert seen == [(1, 1, 1), (2, 2, 2)]


def test_a_research_run_killed_between_charge_and_checkpoint_reruns_identically(
        tiny_corpus, tmp_path, reference):
    config = config_file(tiny_corpus, tmp_path)
    folder = folder_of(tiny_corpus, tmp_path)
    run = Driven("round:2", config)
    run.wait_paused()
    run.kill()
    run.finish()
    ledger = _ledger(folder)
    assert (ledger["rounds_started"], ledger["rounds"]) == (2, 2)  # charged before the kill
    assert status(folder)["round"] == 1  # round 2 never reached its checkpoint
    proc = cli("train", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_identical(folder, reference)  # ε and T included: the rerun released nothing new


def test_a_secure_run_killed_between_charge_and_checkpoint_pays_for_the_lost_round(
        tiny_corpus, tmp_path):
    from reliability_helpers import train_in_process

    secure = ("privacy.secure_mode=true",)
    clean = _ledger(train_in_process(tiny_corpus, tmp_path / "clean", *secure))
    config = config_file(tiny_corpus, tmp_path / "killed", *secure)
    folder = folder_of(tiny_corpus, tmp_path / "killed", *secure)
    run = Driven("round:2", config)
    run.wait_paused()
    run.kill()
    run.finish()
    proc = cli("train", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = _ledger(folder)
    n = clean["population"]
    assert clean["guarantee"] == killed["guarantee"] == "valid"
    assert (clean["rounds"], killed["rounds"], killed["rounds_started"]) == (ROUNDS, ROUNDS + 1,
                                                                           ROUNDS)
    assert clean["epsilon"] == pytest.approx(
        expected_epsilon(tiny_corpus, tmp_path, ROUNDS, *secure, population=n), rel=1e-12)
    assert killed["epsilon"] == pytest.approx(
        expected_epsilon(tiny_corpus, tmp_path, ROUNDS + 1, *secure, population=n), rel=1e-12)
    assert killed["epsilon"] > clean["epsilon"]
    rows = pq.read_table(folder / "rounds.parquet").to_pylist()
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[-1]["epsilon"] == killed["epsilon"]
    assert status(folder)["state"] == "done"
