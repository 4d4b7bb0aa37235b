"""Real variants load local checkpoints with from_pretrained (never downloading): here small
Whisper / Llama / Voxtral checkpoints saved to a temporary folder stand in for the real ones."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import save_voxtral, save_whisper_llama

from cluster_fl.config import ModelConfig
from cluster_fl.errors import UserError
from cluster_fl.models import build_model, describe_groups, greedy_decode, trainable_groups


@pytest.fixture(scope="module")
def local_whisper_llama(tmp_path_factory):
    return save_whisper_llama(tmp_path_factory.mktemp("hf"))


def test_whisper_tinyllama_loads_local_weights(local_whisper_llama, batch):
    cfg = ModelConfig(arch="whisper-tinyllama", encoder_path=str(local_whisper_llama / "whisper"),
                      decoder_path=str(local_whisper_llama / "llama"), lora_rank=2,
                      dtype="float32")  # the model is used directly here, without autocast
    model = build_model(cfg)
    assert model.decoder.config.hidden_size == 64 and len(model.encoder.layers) == 2
    groups = trainable_groups(model)
    assert groups == describe_groups(cfg)  # dimensions read from the local config.json
    assert {g.component for g in groups} == {"encoder", "connector", "decoder"}
    loss, n = model.loss(batch)
    loss.backward()
    assert torch.isfinite(loss) and n > 0
    assert len(greedy_decode(model, batch, 3)) == len(batch.texts)


def test_real_variant_without_paths_is_a_user_error():
    with pytest.raises(UserError, match="decoder_path|encoder_path"):
        build_model(ModelConfig(arch="whisper-eurollm"))
    with pytest.raises(UserError, match="cannot load|not"):
        build_model(ModelConfig(arch="whisper-eurollm", encoder_path="/nonexistent/w",
                                decoder_path="/nonexistent/l", tokenizer_path=None))


def test_voxtral_loads_local_weights_and_separates_tower_from_lm(tmp_path, batch):
    save_voxtral(tmp_path / "vox")
    cfg = ModelConfig(arch="voxtral", decoder_path=str(tmp_path / "vox"), lora_rank=2,
                      dtype="float32")
    model = build_model(cfg)
    assert model.connector.stack == 4  # intermediate_size / hidden_size frames per token
    groups = trainable_groups(model)
    assert [g.component for g in groups].count("encoder") == 2 * 6
    assert [g.component for g in groups].count("decoder") == 2 * 6
    assert groups == describe_groups(cfg)
    loss, _ = model.loss(batch)
    loss.backward()
    assert torch.isfinite(loss)
