"""One round of training on each real MLS layout (OpenSLR FLAC, Hugging Face Parquet), clients
from ``train``, evaluation on ``test``: the store is filled by ``cluster-fl features`` and the run
reads it without computing a feature, or computes a client's parts itself when it was not."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from engine_helpers import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mls_layouts import write_hf_parquet, write_openslr  # noqa: E402

from cluster_fl.cli import main  # noqa: E402
from cluster_fl.errors import UserError  # noqa: E402

SPLITS = {"train": {"1844": 4, "2223": 3, "3119": 3}, "test": {"4004": 2}}
RUN = ["data.languages=[de]", "data.client_split=train", "data.eval_split=test",
       "fl.rounds=1", "fl.sampling=fixed", "fl.clients_per_round=3", "eval.max_utterances=2"]


@pytest.mark.parametrize("writer", [write_openslr, write_hf_parquet])
@pytest.mark.parametrize("features_first", [True, False])
def test_one_round_on_a_real_mls_layout(tmp_path, writer, features_first, monkeypatch):
    import cluster_fl.data.store as store_module
    from cluster_fl.engine.train import run_training

    corpus = writer(tmp_path / "corpus", "german", SPLITS)
    cfg = tiny_config(corpus, tmp_path / "out", *RUN,
                      f"data.feature_cache={tmp_path / 'store'}")
    if features_first:
        path = tmp_path / "c.yaml"
        path.write_text("data: {corpus: %s, languages: [de], client_split: train, "
                        "eval_split: test, feature_cache: %s}\n" % (corpus, tmp_path / "store"))
        assert main(["features", str(path)]) == 0
        computed = []
        real = store_module.log_mel
        monkeypatch.setattr(store_module, "log_mel",
                            lambda *a, **k: computed.append(1) or real(*a, **k))
    torch.set_num_threads(1)
    folder = run_training(cfg)
    final = pq.read_table(folder / "final.parquet").to_pylist()[0]
    assert final["population"] == 3 and 0.0 <= final["wer"]
    if features_first:
        assert computed == []  # everything came from the store
    else:
        assert len(list((tmp_path / "store").rglob("*.pt"))) > 0


def test_a_run_asking_for_a_split_the_corpus_lacks_names_what_it_has(tmp_path):
    from cluster_fl.engine.setup import load_clients

    corpus = write_openslr(tmp_path / "corpus", "german", SPLITS)
    cfg = tiny_config(corpus, tmp_path / "out", "data.languages=[de]")  # client_split private
    with pytest.raises(UserError) as exc:
        load_clients(cfg)
    msg = str(exc.value)
    assert "data.client_split" in msg and "'private'" in msg and "de: test, train" in msg
