"""The synthetic corpus: audio per language, vocabulary, speaker-disjoint splits, manifest."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import numpy as np
import pytest

from cluster_fl.data.corpus import make_corpus, plan_speakers, split_variants
from cluster_fl.data.espeak import VoiceParams, list_variants, phonemes, synthesize
from cluster_fl.data.mls import load_utterances
from cluster_fl.data.vocab import LANGUAGES, WORDS, normalize_text, sample_sentences, vocabulary
from cluster_fl.errors import UserError


@pytest.mark.parametrize("language", LANGUAGES)
def test_every_language_renders_speech_whose_duration_grows_with_text(language):
    words = vocabulary(language)
    short, long = " ".join(words[:2]), " ".join(words[:8])
    voice = VoiceParams(variant="m3")
    a, b = synthesize(short, language, voice), synthesize(long, language, voice)
    for audio in (a, b):
        assert audio.dtype == np.float32 and np.all(np.abs(audio) <= 1.0)
        assert np.sqrt(np.mean(audio ** 2)) > 0.01  # not silence
    assert len(b) > 2 * len(a)
    assert len(a) > 0.2 * 16000  # two words take more than 0.2 s at 16 kHz


@pytest.mark.parametrize("language", LANGUAGES)
def test_vocabulary_has_no_homophones_for_espeak(language):
    sounds = defaultdict(list)
    for word in vocabulary(language):
        sounds[re.sub(r"[',_!%=\s]", "", phonemes(word, language))].append(word)
    assert [w for w in sounds.values() if len(w) > 1] == []
    assert 45 <= len(WORDS[language]) <= 60
    assert all(w == normalize_text(w) for w in vocabulary(language))


def test_sentences_are_seeded_and_use_3_to_8_vocabulary_words():
    a, b = sample_sentences("pl", 50, seed=3), sample_sentences("pl", 50, seed=3)
    assert a == b and a != sample_sentences("pl", 50, seed=4)
    for s in a:
        assert 3 <= len(s.split()) <= 8 and set(s.split()) <= set(vocabulary("pl"))


def test_normalize_text_strips_case_and_punctuation():
    assert normalize_text("  Hello, WORLD!  l'eau -- don't 'quoted' ") == \
        "hello world l'eau don't quoted"
    assert normalize_text("Ça VA? Żółw.") == "ça va żółw"


def test_variants_are_split_three_ways_without_overlap():
    pools = split_variants(seed=0)
    assert len(list_variants()) >= 85
    sets = [set(pools[k]) for k in ("public", "private", "test")]
    assert sum(map(len, sets)) == len(list_variants())
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    specs = plan_speakers(["en"], {"public": 5, "private": 5, "test": 2},
                          {"public": (3, 3), "private": (2, 4), "test": (2, 2)}, seed=0)
    for s in specs:
        assert s.voice.variant in pools[s.split]


def test_transcripts_use_only_the_vocabulary(tiny_corpus):
    utts = load_utterances(tiny_corpus)
    assert utts
    for u in utts:
        assert set(u.transcript.split()) <= set(vocabulary(u.language)), u.utterance_id


def test_splits_are_speaker_disjoint(tiny_corpus):
    speakers = defaultdict(set)
    for u in load_utterances(tiny_corpus):
        speakers[u.split].add(u.speaker)
    assert set(speakers) == {"public", "private", "test"}
    assert not (speakers["public"] & speakers["private"])
    assert not (speakers["public"] & speakers["test"])
    assert not (speakers["private"] & speakers["test"])


def test_manifest_counts_match_the_shards(tiny_corpus):
    manifest = json.loads((tiny_corpus / "manifest.json").read_text())
    utts = load_utterances(tiny_corpus)
    for lang in ("en", "de", "fr"):
        for split in ("public", "private", "test"):
            mine = [u for u in utts if u.language == lang and u.split == split]
            c = manifest["counts"][lang][split]
            assert c["utterances"] == len(mine)
            assert c["speakers"] == len({u.speaker for u in mine})
            assert c["hours"] == pytest.approx(sum(u.duration for u in mine) / 3600, abs=1e-3)
    assert manifest["counts"]["en"]["public"]["utterances"] == 3 * 8


def test_rerun_skips_finished_shards_and_other_parameters_are_refused(tmp_path):
    kwargs = dict(seed=1, public_speakers=1, private_speakers=1, test_speakers=1,
                  utterances_per_speaker=2, workers=1, progress=False)
    make_corpus(tmp_path, ["es"], **kwargs)
    shard = tmp_path / "es" / "public" / "part-00000.parquet"
    stamp = shard.stat().st_mtime_ns
    (tmp_path / "manifest.json").unlink()  # as if the run crashed before the end
    (tmp_path / "es" / "test" / "part-00000.parquet").unlink()
    manifest = make_corpus(tmp_path, ["es"], **kwargs)
    assert shard.stat().st_mtime_ns == stamp  # not rendered again
    assert manifest["counts"]["es"]["test"]["utterances"] == 2
    assert not list(tmp_path.rglob(".*tmp*"))
    with pytest.raises(UserError, match="other parameters.*seed: 1 there, 2 asked"):
        make_corpus(tmp_path, ["es"], **{**kwargs, "seed": 2})


def _shard_digests(root):
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.parquet"))}


def test_shards_are_the_same_bytes_whatever_the_workers_and_after_a_resume(tmp_path):
    # eSpeak's output depends on what its process rendered before: one worker rendering every
    # shard in turn and three workers sharing them out used to give different audio
    kwargs = dict(seed=3, public_speakers=3, private_speakers=2, test_speakers=1,
                  utterances_per_speaker=2, shard_size=2, progress=False)
    one, three = tmp_path / "one", tmp_path / "three"
    make_corpus(one, ["es"], workers=1, **kwargs)
    make_corpus(three, ["es"], workers=3, **kwargs)
    digests = _shard_digests(one)
    assert len(digests) == 6 and digests == _shard_digests(three)
    (three / "manifest.json").unlink()  # a crash that lost two shards, then a resume
    for name in ("es/public/part-00001.parquet", "es/private/part-00000.parquet"):
        (three / name).unlink()
    make_corpus(three, ["es"], workers=2, **kwargs)
    assert _shard_digests(three) == digests
    assert json.loads((one / "corpus.json").read_text())["renderer"] == "process-per-shard"
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (one, three)]
    assert manifests[0]["digest"] == manifests[1]["digest"]
    assert {s["path"]: s["sha256"] for s in manifests[0]["shards"]} == digests


def test_a_finished_corpus_of_the_old_renderer_is_used_and_an_unfinished_one_refused(
        tmp_path, capsys):
    kwargs = dict(seed=1, public_speakers=1, private_speakers=1, test_speakers=1,
                  utterances_per_speaker=1, workers=1, progress=False)
    manifest = make_corpus(tmp_path, ["es"], **kwargs)
    params = json.loads((tmp_path / "corpus.json").read_text())
    del params["renderer"]  # as corpus-v2 folders were written
    (tmp_path / "corpus.json").write_text(json.dumps(params))
    assert make_corpus(tmp_path, ["es"], **kwargs) == manifest
    assert "not reproducible to the byte" in capsys.readouterr().err
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(UserError, match="unfinished corpus of the old renderer"):
        make_corpus(tmp_path, ["es"], **kwargs)


def test_default_speaker_counts_and_their_spread():
    from cluster_fl.data.corpus import DEFAULT_SPEAKERS, _resolve_counts

    counts, utts = _resolve_counts(None, None, None, None, None, 50, (20, 60), 25)
    assert counts == DEFAULT_SPEAKERS == {"public": 80, "private": 30, "test": 4}
    assert utts == {"public": (50, 50), "private": (20, 60), "test": (25, 25)}
    spread, _ = _resolve_counts(57, None, None, None, None, 50, (20, 60), 25)
    assert sum(spread.values()) == 57 and spread["public"] > spread["private"] > spread["test"]


def test_every_default_corpus_path_names_the_versioned_folder():
    from pathlib import Path

    import yaml

    from cluster_fl.config import DataConfig
    from cluster_fl.data.corpus import DEFAULT_FOLDER
    from cluster_fl.data.corpus import default_corpus

    repo = Path(__file__).resolve().parents[2]
    grid = yaml.safe_load((repo / "configs/grids/tiny.yaml").read_text())["set"]
    paths = [DataConfig().corpus, str(default_corpus()), grid["data.corpus"],
             yaml.safe_load((repo / "configs/pretrain.yaml").read_text())["data"]["corpus"]]
    assert all(Path(p).name == DEFAULT_FOLDER for p in paths), paths
    assert Path(grid["model.checkpoint"]).parent.name == DEFAULT_FOLDER


def test_resampling_keeps_the_duration():
    from cluster_fl.data.espeak import Synthesizer, to_16k

    synth = Synthesizer.get()
    synth.set_voice("it", VoiceParams(variant="f2"))
    raw = synth.render_22k("uno due tre quattro")
    assert abs(len(to_16k(raw)) / 16000 - len(raw) / 22050) < 1e-3


def test_make_corpus_command_reports_bad_input_in_one_line(tmp_path, capsys):
    from cluster_fl.cli import main

    assert main(["make-corpus", str(tmp_path), "--languages", "en,xx", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "xx" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["make-corpus", str(tmp_path / "c"), "--languages", "nl", "--public-speakers",
                 "1", "--private-speakers", "1", "--test-speakers", "1",
                 "--utterances-per-speaker", "1", "--workers", "1", "--quiet"]) == 0
    assert "total: 3 utterances" in capsys.readouterr().out
