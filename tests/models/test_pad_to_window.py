"""``model.pad_to_window``: the encoder sees its whole window, as Whisper was trained.

- padded, our encoder path equals Hugging Face's ``WhisperEncoder.forward`` on the same features
  padded to the window with each utterance's silence level, row by row, in a batch of unequal
  lengths;
- unpadded (the default) it does not: the key changes what the encoder computes;
- the connector takes the utterances' own frames either way (same audio token counts).
"""

from __future__ import annotations

import pytest
import torch

from cluster_fl.config import ModelConfig
from cluster_fl.models import build_model


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    padded = build_model(ModelConfig(pad_to_window=True)).eval()
    torch.manual_seed(0)
    plain = build_model(ModelConfig()).eval()
    return padded, plain


def _batch(n_mels: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    feats = torch.full((len(lengths), n_mels, max(lengths)), 7.0)  # padding: must not matter
    for i, n in enumerate(lengths):
        feats[i, :, :n] = torch.rand(n_mels, n, generator=g) * 2 - 1
    return feats, torch.tensor(lengths)


def test_padded_encoder_equals_hugging_face_whisper_encoder_forward(models):
    padded, _ = models
    assert padded.pad_to_window
    enc = padded.encoder
    window = 2 * enc.embed_positions.weight.shape[0]
    feats, lengths = _batch(enc.conv1.in_channels, [window // 3, window // 2 + 5, 41])
    with torch.no_grad():
        states, out_len = padded.encode(feats, lengths)
        for i, n in enumerate(lengths.tolist()):
            own = feats[i:i + 1, :, :n]
            silence = own.min()
            whole = torch.cat([own, silence.expand(1, own.shape[1], window - n)], dim=-1)
            ref = enc(input_features=whole).last_hidden_state  # HF's forward, 30 s style
            t = (n - 1) // 2 + 1
            assert out_len[i] == t
            torch.testing.assert_close(states[i, :t], ref[0, :t], rtol=1e-4, atol=1e-5)


def test_unpadded_default_differs_and_token_counts_agree(models):
    padded, plain = models
    assert not plain.pad_to_window
    feats, lengths = _batch(plain.encoder.conv1.in_channels, [60, 90])
    with torch.no_grad():
        a, la = padded.encode(feats, lengths)
        b, lb = plain.encode(feats, lengths)
        emb_a, n_a, _, _ = padded.audio_embeddings(feats, lengths)
        emb_b, n_b, _, _ = plain.audio_embeddings(feats, lengths)
    assert a.shape == b.shape and torch.equal(la, lb) and torch.equal(n_a, n_b)
    assert not torch.allclose(a[0, :30], b[0, :30], atol=1e-3)
    assert emb_a.shape == emb_b.shape


def test_pad_to_window_is_a_checked_boolean():
    from cluster_fl.config import ConfigError, load_config

    assert load_config(None, ["model.pad_to_window=true"]).model.pad_to_window is True
    with pytest.raises(ConfigError, match="model.pad_to_window"):
        load_config(None, ["model.pad_to_window=sometimes"])


def test_a_padded_model_trains(models):
    padded, _ = models
    feats, lengths = _batch(padded.encoder.conv1.in_channels, [50, 80])
    padded.train()
    try:
        loss, n = padded.loss({"features": feats, "lengths": lengths,
                               "texts": ["guten tag", "welt"], "languages": ["de", "de"]})
        loss.backward()
    finally:
        padded.eval()
    assert torch.isfinite(loss) and n > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0
               for p in padded.encoder.parameters() if p.requires_grad)
