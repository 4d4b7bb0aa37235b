"""The MLS-layout reader: round trip, foreign (HF MLS) layout, corrupt rows, client partition."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from cluster_fl.config import DataConfig
from cluster_fl.data.mls import (CorpusWarning, count_clients, format_partition_report,
                                 load_utterances, partition_clients, partition_report)


def test_reader_reads_what_the_writer_wrote(tiny_corpus):
    utts = load_utterances(tiny_corpus, languages=["de"], splits=["test"], decode=True)
    table = pq.read_table(tiny_corpus / "de" / "test" / "part-00000.parquet")
    assert [u.utterance_id for u in utts] == table.column("utterance_id").to_pylist()
    assert [u.transcript for u in utts] == table.column("transcript").to_pylist()
    for u, cell in zip(utts, table.column("audio").to_pylist()):
        pcm, rate = sf.read(io.BytesIO(cell["bytes"]), dtype="float32")
        assert rate == 16000 and np.array_equal(u.audio, pcm)
        assert u.duration == pytest.approx(len(pcm) / 16000)
        assert u.language == "de" and u.split == "test"


def test_max_utterances_keeps_every_language(tiny_corpus):
    utts = load_utterances(tiny_corpus, splits=["public"], max_utterances=9)
    assert len(utts) == 9 and {u.language for u in utts} == {"en", "de", "fr"}


def _hf_mls_shard(path, rows):
    """A shard as published on the HF hub: audio{bytes,path}, speaker_id, id, audio_duration."""
    audio = []
    for i in range(rows):
        buf = io.BytesIO()
        sf.write(buf, np.sin(np.arange(16000) * (0.05 + 0.01 * i)).astype(np.float32) * 0.3,
                 16000, format="FLAC")
        audio.append({"bytes": buf.getvalue(), "path": f"{i}.flac"})
    audio[1] = {"bytes": b"not a flac file", "path": "bad.flac"}  # a corrupt row
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "audio": audio, "original_path": ["x"] * rows,
        "transcript": ["Bonjour, le Monde!"] * rows,
        "speaker_id": ["1840", "1840", "2223", "2223"][:rows],
        "id": [f"fr_{i}" for i in range(rows)], "audio_duration": [1.0] * rows}), path)


def test_hf_mls_layout_is_read_and_corrupt_row_reported_with_its_id(tmp_path):
    _hf_mls_shard(tmp_path / "french" / "train-00000-of-00001.parquet", 4)
    _hf_mls_shard(tmp_path / "french" / "test-00000-of-00001.parquet", 4)
    meta = load_utterances(tmp_path, splits=["train"])
    assert [u.utterance_id for u in meta] == ["fr_0", "fr_1", "fr_2", "fr_3"]
    assert meta[0].language == "fr" and meta[0].transcript == "bonjour le monde"
    errors: list[dict] = []
    with pytest.warns(CorpusWarning, match="fr_1"):
        utts = load_utterances(tmp_path, languages=["fr"], splits=["train"], decode=True,
                               errors=errors)
    assert [u.utterance_id for u in utts] == ["fr_0", "fr_2", "fr_3"]
    assert [e["utterance_id"] for e in errors] == ["fr_1"]
    assert len(utts[0].audio) == 16000


def test_partition_is_one_language_per_client_with_stable_sorted_ids(tiny_corpus):
    utts = load_utterances(tiny_corpus, splits=["private"])
    clients = partition_clients(utts)
    assert [c.index for c in clients] == list(range(9))
    assert [(c.language, c.speaker) for c in clients] == \
        sorted((c.language, c.speaker) for c in clients)
    for c in clients:
        assert {u.language for u in c.utterances} == {c.language}
        assert {u.speaker for u in c.utterances} == {c.speaker}
    again = partition_clients(list(reversed(utts)))
    assert [c.client_id for c in again] == [c.client_id for c in clients]
    capped = partition_clients(utts, max_clients=3, max_utterances_per_client=2)
    assert {c.language for c in capped} == {"en", "de", "fr"}
    assert all(len(c.utterances) == 2 for c in capped)


def test_a_speaker_in_two_languages_becomes_two_clients(tiny_corpus):
    utts = load_utterances(tiny_corpus, languages=["en", "de"], splits=["private"])
    for u in utts:
        u.speaker = "same"
    clients = partition_clients(utts)
    assert [(c.language, c.speaker) for c in clients] == [("de", "same"), ("en", "same")]


def test_partition_report_counts_clients_utterances_and_hours(tiny_corpus):
    utts = load_utterances(tiny_corpus, splits=["private"])
    report = partition_report(partition_clients(utts))
    assert report["clients"] == 9 and report["utterances"] == len(utts)
    sizes = [len([u for u in utts if u.speaker == s]) for s in {u.speaker for u in utts}]
    assert report["utterances_per_client"]["min"] == min(sizes)
    assert report["utterances_per_client"]["max"] == max(sizes)
    assert report["languages"]["de"]["clients"] == 3
    assert report["hours"] == pytest.approx(sum(u.duration for u in utts) / 3600, abs=1e-3)
    text = format_partition_report(report)
    assert text.splitlines()[-1].split()[:3] == ["all", "9", str(len(utts))]


def test_count_clients_follows_the_data_config(tiny_corpus):
    cfg = DataConfig(corpus=str(tiny_corpus), languages=("en", "fr"))
    assert count_clients(cfg) == 6
    assert count_clients(DataConfig(corpus=str(tiny_corpus), max_clients=4)) == 4
    assert count_clients(DataConfig(corpus=str(tiny_corpus), client_split="test")) == 3


def test_missing_corpus_is_a_user_error(tmp_path):
    from cluster_fl.errors import UserError

    with pytest.raises(UserError, match="make-corpus"):
        load_utterances(tmp_path / "nope")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserError, match="no shards"):
            load_utterances(tmp_path)
