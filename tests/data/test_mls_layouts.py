"""Both real MLS layouts: OpenSLR (FLAC, Opus) and Hugging Face Parquet, real split names, and
errors that say what a corpus has.

- OpenSLR is detected from the folder, durations come from ``segments.txt`` without decoding,
  audio from ``audio/<speaker>/<book>/<id>.flac|.opus``;
- Opus without a libsndfile that decodes it is one line naming the file and what to install;
- a missing or undecodable audio file is reported with its id and skipped;
- asking for a split or language the corpus lacks names the languages and splits it has.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mls_layouts import write_hf_parquet, write_openslr  # noqa: E402

from cluster_fl.data.mls import (CorpusWarning, find_shards, load_utterances,  # noqa: E402
                                 partition_clients)
from cluster_fl.errors import UserError  # noqa: E402

SPLITS = {"train": {"1844": 5, "2223": 4}, "dev": {"3001": 3}, "test": {"4004": 3}}


def test_openslr_layout_is_detected_and_read_with_real_split_names(tmp_path):
    write_openslr(tmp_path, "german", SPLITS)
    shards = find_shards(tmp_path)
    assert [(s.language, s.split, s.layout) for s in shards] == [
        ("de", "dev", "openslr"), ("de", "test", "openslr"), ("de", "train", "openslr")]
    meta = load_utterances(tmp_path, ["de"], ["train"])
    assert [u.speaker for u in meta] == ["1844"] * 5 + ["2223"] * 4
    assert all(u.duration is not None for u in meta)  # from segments.txt, nothing decoded
    decoded = load_utterances(tmp_path, ["de"], ["train"], decode=True)
    for m, d in zip(meta, decoded):
        assert d.duration == pytest.approx(m.duration, abs=0.01)
        pcm, _ = sf.read(tmp_path / "mls_german" / "train" / "audio" / d.speaker /
                         d.utterance_id.split("_")[1] / f"{d.utterance_id}.flac", dtype="float32")
        assert np.array_equal(d.audio, pcm)
        assert d.transcript == m.transcript and d.transcript
    clients = partition_clients(meta)
    assert [c.client_id for c in clients] == ["de/1844", "de/2223"]


def test_opus_is_decoded_when_libsndfile_can(tmp_path):
    if "OPUS" not in sf.available_subtypes("OGG"):
        pytest.skip("this libsndfile does not write Opus")
    write_openslr(tmp_path, "polish", {"test": {"77": 2}}, fmt="OGG")
    utts = load_utterances(tmp_path, ["pl"], ["test"], decode=True)
    assert len(utts) == 2 and utts[0].audio.dtype == np.float32
    assert len(utts[0].audio) == pytest.approx(16000 * utts[0].duration, abs=1)
    assert np.abs(utts[0].audio).max() > 0.1  # a tone, resampled from 48 kHz


def test_opus_without_a_decoder_is_one_line_naming_the_file(tmp_path, monkeypatch):
    write_openslr(tmp_path, "polish", {"test": {"77": 1}}, fmt="OGG" if "OPUS" in
                  sf.available_subtypes("OGG") else "FLAC")
    audio = next((tmp_path / "mls_polish").rglob("*_000000.*"))
    if audio.suffix != ".opus":
        audio.rename(audio.with_suffix(".opus"))
    monkeypatch.setattr(sf, "available_subtypes", lambda fmt=None: {"VORBIS": "Vorbis"})
    with pytest.raises(UserError) as exc:
        load_utterances(tmp_path, ["pl"], ["test"], decode=True)
    msg = str(exc.value)
    assert "\n" not in msg and "77_100_000000.opus" in msg and "libsndfile >= 1.0.29" in msg


def test_missing_or_undecodable_audio_is_reported_with_its_id_and_skipped(tmp_path):
    write_openslr(tmp_path, "german", {"train": {"1844": 4}})
    audio = sorted((tmp_path / "mls_german" / "train" / "audio").rglob("*.flac"))
    audio[0].unlink()
    audio[2].write_bytes(b"not a flac file")
    errors: list[dict] = []
    with pytest.warns(CorpusWarning) as caught:
        utts = load_utterances(tmp_path, ["de"], ["train"], decode=True, errors=errors)
    assert [u.utterance_id for u in utts] == [audio[1].stem, audio[3].stem]
    assert [e["utterance_id"] for e in errors] == [audio[0].stem, audio[2].stem]
    assert {str(w.message).split()[2] for w in caught} == {audio[0].stem, audio[2].stem}


@pytest.mark.parametrize("writer", [write_openslr, write_hf_parquet])
def test_a_missing_split_or_language_names_what_the_corpus_has(tmp_path, writer):
    writer(tmp_path, "german", SPLITS)
    with pytest.raises(UserError) as exc:
        load_utterances(tmp_path, ["de"], ["private"])
    assert "de: dev, test, train" in str(exc.value) and "private" in str(exc.value)
    with pytest.raises(UserError) as exc:
        load_utterances(tmp_path, ["fr"], ["train"])
    assert "de: dev, test, train" in str(exc.value) and "fr" in str(exc.value)


def test_hf_parquet_speakers_span_shards_and_read_as_one_client(tmp_path):
    write_hf_parquet(tmp_path, "german", SPLITS)
    assert len(find_shards(tmp_path, ["de"], ["train"])) == 2
    clients = partition_clients(load_utterances(tmp_path, ["de"], ["train"]))
    assert [(c.client_id, len(c.utterances)) for c in clients] == [("de/1844", 5),
                                                                   ("de/2223", 4)]
    assert len({u.shard for u in clients[0].utterances}) == 2
