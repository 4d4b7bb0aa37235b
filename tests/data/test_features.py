"""Log-mel features: Whisper parity, on-disk cache, padded batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster_fl.data.features import log_mel, pad_examples
from cluster_fl.data.store import FeatureStore
from cluster_fl.data.mls import load_utterances, partition_clients

torch.set_num_threads(1)


def test_log_mel_matches_whisper_feature_extractor(tiny_corpus):
    from transformers import WhisperFeatureExtractor

    audio = load_utterances(tiny_corpus, ["fr"], ["test"], decode=True)[0].audio
    ref = WhisperFeatureExtractor()._np_extract_fbank_features(audio[None].astype(np.float64),
                                                               "cpu")[0]
    mine = log_mel(audio).numpy()
    assert mine.shape == ref.shape == (80, len(audio) // 160)
    np.testing.assert_allclose(mine, ref, atol=1e-4)
    assert log_mel(audio, n_mels=128).shape == (128, len(audio) // 160)


def test_cache_hit_returns_the_same_tensor_without_recomputing(tiny_corpus, tmp_path):
    store = FeatureStore(tiny_corpus, tmp_path)
    first = store.split("test")
    assert store.computed_parts == 3 and len(first) == 3 * 6
    fresh = FeatureStore(tiny_corpus, tmp_path)  # a new process would see only the disk
    fresh_calls = []
    import cluster_fl.data.store as store_module
    real = store_module.log_mel
    store_module.log_mel = lambda *a, **k: fresh_calls.append(1) or real(*a, **k)
    try:
        second = fresh.split("test")
    finally:
        store_module.log_mel = real
    assert fresh.computed_parts == 0 and fresh_calls == []
    assert [e.utterance_id for e in second] == [e.utterance_id for e in first]
    for a, b in zip(first, second):
        assert torch.equal(a.features, b.features) and a.features.dtype == torch.float16
    other = FeatureStore(tiny_corpus, tmp_path, n_mels=40)  # other params: other cache key
    assert other.split("test", languages=["en"])[0].features.shape[0] == 40
    assert other.computed_parts == 1


def test_client_examples_carry_labels_and_features_grow_with_audio(tiny_corpus, tmp_path):
    store = FeatureStore(tiny_corpus, tmp_path)
    client = partition_clients(load_utterances(tiny_corpus, ["de"], ["private"]))[0]
    examples = store.client(client)
    assert [e.utterance_id for e in examples] == [u.utterance_id for u in client.utterances]
    for e, u in zip(examples, client.utterances):
        assert e.speaker == client.speaker and e.language == "de"
        assert e.transcript == u.transcript
        assert e.features.shape[1] == int(u.duration * 16000) // 160


def test_pad_examples_pads_and_reports_lengths(tiny_corpus, tmp_path):
    examples = FeatureStore(tiny_corpus, tmp_path).split("test", ["en"])[:4]
    batch = pad_examples(examples)
    lengths = [e.features.shape[1] for e in examples]
    assert batch["features"].shape == (4, 80, max(lengths))
    assert batch["features"].dtype == torch.float32
    assert batch["lengths"].tolist() == lengths
    i = int(np.argmin(lengths))
    assert torch.equal(batch["features"][i, :, :lengths[i]], examples[i].features.float())
    assert torch.all(batch["features"][i, :, lengths[i]:] == examples[i].features.float().min())
    assert batch["transcripts"] == [e.transcript for e in examples]
    with pytest.raises(ValueError):
        pad_examples([])
