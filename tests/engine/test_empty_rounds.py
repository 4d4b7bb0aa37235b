"""Nothing silent when no client contributes.

- a round whose every update is non-finite, or whose clients have no usable audio, or whose
  Poisson cohort is empty, has ``empty = 1`` in its row (read from the exact sum: a noised count
  could not tell); one contributing client makes it ``empty = 0``, in DP and in FedAvg runs;
- a real run where every round is empty warns in the log for each round, records the flags in
  rounds.parquet, and fails in one line (status ``failed`` with the reason) instead of "done".
"""

from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import (FAKE_GROUPS, FakeRunner, engine_config, make_engine,
                            random_update, tiny_config, zero_state)

from cluster_fl.engine.round import ClientData
from cluster_fl.errors import UserError


def _nan(client, round_):
    return {s.name: torch.full(s.shape, float("nan")) for s in FAKE_GROUPS}


@pytest.mark.parametrize("mechanism", ["gaussian", "none"])
def test_a_round_of_non_finite_updates_is_empty_and_one_finite_client_is_not(mechanism):
    cfg = engine_config("fl.clients_per_round=4", f"privacy.mechanism={mechanism}")
    out = make_engine(cfg, FakeRunner(_nan), 6).run_round(1, zero_state())
    assert out.row["empty"] == 1 and out.row["n_cohort"] == 4

    def all_but_one(client, round_):
        return random_update(client, round_) if client == 0 else _nan(client, round_)

    cfg = engine_config("fl.clients_per_round=6", f"privacy.mechanism={mechanism}")
    out = make_engine(cfg, FakeRunner(all_but_one), 6).run_round(1, zero_state())
    assert out.row["empty"] == 0


def test_clients_without_usable_audio_and_an_empty_cohort_make_empty_rounds():
    clients = [ClientData(index=i, client_id=f"c{i}", speaker=f"s{i}", language="en",
                          utterances=[]) for i in range(4)]
    cfg = engine_config("fl.clients_per_round=4")
    runner = FakeRunner(random_update)
    out = make_engine(cfg, runner, 4, clients=clients).run_round(1, zero_state())
    assert out.row["empty"] == 1 and runner.calls == []
    # Poisson sampling with a tiny rate: find a round that drew nobody
    cfg = engine_config("fl.sampling=poisson", "fl.clients_per_round=1")
    engine = make_engine(cfg, FakeRunner(random_update), 40)
    r = next(r for r in range(1, 500) if not engine.cohort(r)[0])
    assert engine.run_round(r, zero_state()).row["empty"] == 1


def test_a_run_where_no_client_ever_contributed_fails_in_one_line(tiny_corpus, tmp_path,
                                                                 monkeypatch):
    import pyarrow.parquet as pq

    from cluster_fl.engine import client as client_mod
    from cluster_fl.engine.rundir import run_dir
    from cluster_fl.engine.train import run_training

    train = client_mod.ClientRunner.train

    def diverge(self, *args, **kwargs):  # what fl.lr=10 does to a long local run
        upd = train(self, *args, **kwargs)
        upd.delta = {k: torch.full_like(v, float("inf")) for k, v in upd.delta.items()}
        return upd

    monkeypatch.setattr(client_mod.ClientRunner, "train", diverge)
    torch.set_num_threads(1)
    cfg = tiny_config(tiny_corpus, tmp_path)
    with pytest.raises(UserError, match="no client contributed in any of the 2 rounds"):
        run_training(cfg)
    folder = run_dir(cfg)
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "failed" and "no client contributed" in status["error"]
    rows = pq.read_table(folder / "rounds.parquet").to_pylist()
    assert [r["empty"] for r in rows] == [1, 1]
    log = (folder / "log.txt").read_text()
    assert "warning: round 1: no client contributed" in log
    assert "warning: round 2: no client contributed" in log
    assert not (folder / "final.parquet").exists()
