"""Nothing silent when no client contributes -- and nothing exact released about it.

- a round whose every update is non-finite, or whose clients have no usable audio, or whose
  Poisson cohort is empty, says so in its operator facts (:attr:`RoundOutput.operator`: the
  realised cohort, clients trained, non-finite, skipped), read from this rank's own clients; the
  released row carries no flag and no count that is not noised, in DP and in FedAvg runs;
- a real DP run (noised diagnostics) where every round is empty warns the operator -- in the
  operator log outside the run folder and on stderr -- and ends as it is: its log.txt, rows,
  final row and status hold no trace of the exact counts (deciding on them would release them);
- the same run with diagnostics released exactly (``privacy.diagnostics: exact``, void) fails
  in one line, decided on what its rows release (status ``failed`` with the reason).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from engine_helpers import (FAKE_GROUPS, FakeRunner, engine_config, make_engine,
                            random_update, tiny_config, zero_state)

from cluster_fl.engine.operator_log import operator_dir, read_operator_log
from cluster_fl.engine.round import ClientData
from cluster_fl.errors import UserError

EXACT_FACTS = {"n_cohort", "empty", "wall_s", "empty_rounds", "skipped_utterances"}


def _nan(client, round_):
    return {s.name: torch.full(s.shape, float("nan")) for s in FAKE_GROUPS}


@pytest.mark.parametrize("mechanism", ["gaussian", "none"])
def test_a_round_of_non_finite_updates_is_told_to_the_operator_and_one_finite_client_too(
        mechanism):
    cfg = engine_config("fl.clients_per_round=4", f"privacy.mechanism={mechanism}")
    out = make_engine(cfg, FakeRunner(_nan), 6).run_round(1, zero_state())
    assert (out.operator["cohort"], out.operator["trained"], out.operator["nonfinite"]) == (4, 4, 4)
    assert not EXACT_FACTS & set(out.row) and out.operator["wall_s"] > 0

    def all_but_one(client, round_):
        return random_update(client, round_) if client == 0 else _nan(client, round_)

    cfg = engine_config("fl.clients_per_round=6", f"privacy.mechanism={mechanism}")
    out = make_engine(cfg, FakeRunner(all_but_one), 6).run_round(1, zero_state())
    assert out.operator["trained"] - out.operator["nonfinite"] == 1


def test_clients_without_usable_audio_and_an_empty_cohort_are_told_to_the_operator():
    clients = [ClientData(index=i, client_id=f"c{i}", speaker=f"s{i}", language="en",
                          utterances=[]) for i in range(4)]
    cfg = engine_config("fl.clients_per_round=4")
    runner = FakeRunner(random_update)
    out = make_engine(cfg, runner, 4, clients=clients).run_round(1, zero_state())
    assert out.operator["skipped"] == 4 and out.operator["trained"] == 0 and runner.calls == []
    # Poisson sampling with a tiny rate: find a round that drew nobody
    cfg = engine_config("fl.sampling=poisson", "fl.clients_per_round=1")
    engine = make_engine(cfg, FakeRunner(random_update), 40)
    r = next(r for r in range(1, 500) if not engine.cohort(r)[0])
    out = engine.run_round(r, zero_state())
    assert out.operator["cohort"] == 0 and not EXACT_FACTS & set(out.row)
    assert out.row["denominator"] == 1.0  # the public q·N, not the realised 0


@pytest.fixture
def diverging(monkeypatch):
    from cluster_fl.engine import client as client_mod

    train = client_mod.ClientRunner.train

    def diverge(self, *args, **kwargs):  # what fl.lr=10 does to a long local run
        upd = train(self, *args, **kwargs)
        upd.delta = {k: torch.full_like(v, float("inf")) for k, v in upd.delta.items()}
        return upd

    monkeypatch.setattr(client_mod.ClientRunner, "train", diverge)
    torch.set_num_threads(1)


def test_a_dp_run_where_no_client_ever_contributed_warns_the_operator_only(
        tiny_corpus, tmp_path, diverging, capfd):
    from cluster_fl.engine.train import run_training

    folder = run_training(tiny_config(tiny_corpus, tmp_path, "fl.rounds=1"))
    assert json.loads((folder / "status.json").read_text())["state"] == "done"
    warnings = [e["message"] for e in read_operator_log(folder) if e["event"] == "warning"]
    assert any("round 1: no client contributed" in w for w in warnings), warnings
    assert any("no client contributed in any of the 1 round" in w for w in warnings), warnings
    assert "operator warning" in capfd.readouterr().err
    assert "no client contributed" not in (folder / "log.txt").read_text()
    assert operator_dir(folder) != folder and not str(operator_dir(folder)).startswith(str(folder))
    for name in ("rounds.parquet", "final.parquet"):
        for row in pq.read_table(folder / name).to_pylist():
            assert not EXACT_FACTS & set(row), (name, sorted(EXACT_FACTS & set(row)))


def test_a_run_with_exact_diagnostics_where_no_client_contributed_fails_in_one_line(
        tiny_corpus, tmp_path, diverging):
    from cluster_fl.engine.rundir import run_dir
    from cluster_fl.engine.train import run_training

    cfg = tiny_config(tiny_corpus, tmp_path, "privacy.diagnostics=exact")
    with pytest.raises(UserError, match="no client contributed in any of the 2 rounds"):
        run_training(cfg)
    folder = run_dir(cfg)
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "failed" and "no client contributed" in status["error"]
    rows = pq.read_table(folder / "rounds.parquet").to_pylist()
    assert len(rows) == 2 and all(r["n_clients"] == r["n_nonfinite"] for r in rows)
    assert not (folder / "final.parquet").exists()
