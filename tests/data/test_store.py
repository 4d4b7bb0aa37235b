"""The features store: per speaker, an index per shard, one client read at a time.

- clients built from the indexes are the clients ``partition_clients`` makes from every row's
  metadata, and their examples are the features computed from the audio, bit for bit;
- a client's examples read that speaker's parts and nothing else;
- ``cluster-fl features`` fills the store for both MLS layouts, split over ``--part i/n`` tasks,
  resumes after a crash, and a second call does no work.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mls_layouts import write_hf_parquet, write_openslr  # noqa: E402

import cluster_fl.data.store as store_module  # noqa: E402
from cluster_fl.cli import main  # noqa: E402
from cluster_fl.data.features import log_mel  # noqa: E402
from cluster_fl.data.mls import load_utterances, partition_clients  # noqa: E402
from cluster_fl.data.store import FeatureStore  # noqa: E402

torch.set_num_threads(1)
SPLITS = {"train": {"1844": 5, "2223": 4, "3119": 3}, "test": {"4004": 3}}


@pytest.mark.parametrize("caps", [(0, 0), (5, 3)])
def test_indexed_clients_are_partition_clients_with_the_same_features(tiny_corpus, tmp_path,
                                                                       caps):
    max_clients, cap = caps
    store = FeatureStore(tiny_corpus, tmp_path, progress=False)
    indexed = store.clients("private", ["en", "de", "fr"], max_clients, cap)
    utts = load_utterances(tiny_corpus, ["en", "de", "fr"], ["private"])
    listed = partition_clients(utts, max_clients, cap)
    assert [(c.index, c.client_id, c.size) for c in indexed] == \
        [(c.index, c.client_id, len(c.utterances)) for c in listed]
    audio = {u.utterance_id: u.audio for u in
             load_utterances(tiny_corpus, ["en", "de", "fr"], ["private"], decode=True)}
    for ic, lc in zip(indexed, listed):
        examples = store.client(ic)
        assert [e.utterance_id for e in examples] == [u.utterance_id for u in lc.utterances]
        assert [e.transcript for e in examples] == [u.transcript for u in lc.utterances]
        for e in examples:
            assert torch.equal(e.features, log_mel(audio[e.utterance_id]).to(torch.float16))
    assert sum(c.seconds for c in indexed) == pytest.approx(
        sum(u.duration for c in listed for u in c.utterances), rel=1e-6 if not cap else 0.5)


def test_a_client_reads_its_own_parts_and_nothing_else(tiny_corpus, tmp_path, monkeypatch):
    store = FeatureStore(tiny_corpus, tmp_path, progress=False)
    clients = store.clients("private", ["de"])
    for c in clients:
        store.client(c)  # every part computed
    loaded: list[Path] = []
    real = torch.load
    monkeypatch.setattr(store_module.torch, "load",
                        lambda path, **k: loaded.append(Path(path)) or real(path, **k))
    fresh = FeatureStore(tiny_corpus, tmp_path, progress=False)
    examples = fresh.client(fresh.clients("private", ["de"])[1])
    assert fresh.computed_parts == 0 and examples
    assert loaded and {p.parent.name for p in loaded} == {clients[1].speaker}


def _config(tmp_path: Path, corpus: Path) -> Path:
    path = tmp_path / "mls.yaml"
    path.write_text(f"data:\n  corpus: {corpus}\n  languages: [de]\n  client_split: train\n"
                    f"  eval_split: test\n  feature_cache: {tmp_path / 'store'}\n")
    return path


@pytest.mark.parametrize("writer", [write_openslr, write_hf_parquet])
def test_features_command_fills_the_store_in_parts_and_a_second_call_does_no_work(
        tmp_path, writer, capsys):
    corpus = writer(tmp_path / "corpus", "german", SPLITS)
    cfg = _config(tmp_path, corpus)
    assert main(["features", str(cfg), "--part", "0/2"]) == 0
    assert main(["features", str(cfg), "--part", "1/2"]) == 0
    out = capsys.readouterr().out.splitlines()
    computed = [int(re.search(r"(\d+) part\(s\) computed", line).group(1)) for line in out]
    parts = sorted((tmp_path / "store").rglob("*.pt"))
    # openslr: one part per (speaker, book); parquet: one per (speaker, shard)
    assert sum(computed) == len(parts) == 3 * 2 + 2
    assert all(computed)  # both tasks had work
    assert main(["features", str(cfg)]) == 0
    assert " 0 part(s) computed" in capsys.readouterr().out
    store = FeatureStore(corpus, tmp_path / "store", progress=False)
    for c in store.clients("train", ["de"]):
        assert len(store.client(c)) == c.size
    assert store.computed_parts == 0


def test_features_command_resumes_after_a_crash(tmp_path, monkeypatch, capsys):
    corpus = write_openslr(tmp_path / "corpus", "german", SPLITS)
    cfg = _config(tmp_path, corpus)
    calls = []
    real = store_module.log_mel

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == 9:
            raise KeyboardInterrupt  # the job killed in the middle of a part
        return real(*a, **k)

    monkeypatch.setattr(store_module, "log_mel", dying)
    assert main(["features", str(cfg)]) == 130
    written = sorted((tmp_path / "store").rglob("*.pt"))
    assert 0 < len(written) < 8 and not list((tmp_path / "store").rglob(".*tmp*"))
    monkeypatch.setattr(store_module, "log_mel", real)
    assert main(["features", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f" {8 - len(written)} part(s) computed" in out


def test_the_features_command_shows_its_progress_over_its_share_of_the_work(tmp_path,
                                                                           monkeypatch):
    corpus = write_openslr(tmp_path / "corpus", "german", SPLITS)
    cfg = _config(tmp_path, corpus)
    seen = []

    def spy(items, **kw):  # cluster_fl.progress.progress: a bar on a terminal, lines in a log
        seen.append((len(items), kw.get("desc"), kw.get("enabled")))
        yield from items

    monkeypatch.setattr(store_module, "progress", spy)
    assert main(["features", str(cfg), "--part", "1/2"]) == 0
    assert len(seen) == 1 and seen[0][1:] == ("features", True) and seen[0][0] > 0


def test_features_of_a_grid_fill_each_distinct_store_once(tmp_path, capsys):
    corpus = write_hf_parquet(tmp_path / "corpus", "german", SPLITS)
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        f"experiment: g\nout: {tmp_path / 'out'}\nseeds: [0, 1]\n"
        f"set: {{data.corpus: {corpus}, data.languages: [de], data.client_split: train, "
        f"data.eval_split: test}}\n"
        "axes:\n  method:\n    - {name: a, set: {privacy.clipping: flat}}\n"
        "    - {name: b, set: {privacy.clipping: size}}\n"
        f"  store:\n    - {{name: one, set: {{data.feature_cache: {tmp_path / 's1'}}}}}\n"
        f"    - {{name: two, set: {{data.feature_cache: {tmp_path / 's2'}}}}}\n")
    assert main(["features", str(grid)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2  # 8 runs, 2 distinct data settings
    assert len(list((tmp_path / "s1").rglob("*.pt"))) == len(list((tmp_path / "s2").rglob(
        "*.pt"))) == 3 * 2 + 2


@pytest.mark.parametrize("writer", [write_openslr, write_hf_parquet])
def test_features_for_max_clients_compute_those_speakers_and_every_test_speaker(tmp_path, writer):
    corpus = writer(tmp_path / "corpus", "german", SPLITS)
    cfg = _config(tmp_path, corpus)
    assert main(["features", str(cfg), "data.max_clients=2"]) == 0
    speakers = {p.parent.name for p in (tmp_path / "store").rglob("*.pt")}
    assert speakers == {"1844", "2223", "4004"}  # the 2 clients of 3, and the test speaker
    store = FeatureStore(corpus, tmp_path / "store", progress=False)
    for c in store.clients("train", ["de"], max_clients=2):
        store.client(c)
    assert store.computed_parts == 0
    assert main(["features", str(cfg)]) == 0  # every client now: only the third is computed
    assert {p.parent.name for p in (tmp_path / "store").rglob("*.pt")} == speakers | {"3119"}


def test_utterances_of_interleaved_speakers_read_each_part_once(tmp_path, monkeypatch):
    corpus = write_hf_parquet(tmp_path / "corpus", "german", SPLITS)
    store = FeatureStore(corpus, tmp_path / "store", progress=False)
    utts = load_utterances(corpus, ["de"], ["train"])
    first = store.examples(utts)  # computes every part
    shuffled = sorted(utts, key=lambda u: (u.duration, u.utterance_id))  # as evaluation plans
    assert len({u.speaker for u in shuffled[:3]}) > 1
    loaded: list[Path] = []
    real = torch.load
    monkeypatch.setattr(store_module.torch, "load",
                        lambda path, **k: loaded.append(Path(path)) or real(path, **k))
    again = store.examples(shuffled)
    assert len(loaded) == len(set(loaded)) == len(list((tmp_path / "store").rglob("*.pt")))
    by_id = {e.utterance_id: e for e in first}
    assert [e.utterance_id for e in again] == [u.utterance_id for u in shuffled]
    assert all(torch.equal(e.features, by_id[e.utterance_id].features) for e in again)
