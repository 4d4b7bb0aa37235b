"""Shapes follow the model: the mel bins of the features -- and the extractor
behind them -- come from the model's registry entry or its local checkpoint, and a config that
contradicts the model is refused when it is read, naming both values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_checkpoints import save_voxtral, save_whisper_llama

from cluster_fl.config import ConfigError, load_config
from cluster_fl.errors import UserError
from cluster_fl.models.registry import REGISTRY, feature_shape, resolve_shapes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_whisper_llama(tmp_path_factory):
    return save_whisper_llama(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("arch", sorted(REGISTRY))
def test_n_mels_defaults_to_the_registered_models(arch):
    cfg = resolve_shapes(load_config(None, [f"model.arch={arch}"]))
    assert cfg.data.n_mels == REGISTRY[arch].n_mels
    assert resolve_shapes(cfg) == cfg  # idempotent: every entry point may call it
    assert REGISTRY[arch].n_mels == (80 if REGISTRY[arch].tiny else 128)


def test_a_contradicting_n_mels_is_refused_naming_both_values():
    with pytest.raises(ConfigError) as exc:
        resolve_shapes(load_config(None, ["model.arch=whisper-eurollm-9b", "data.n_mels=80"]))
    assert exc.value.key == "data.n_mels"
    assert "got 80" in str(exc.value) and "takes 128 mel bins" in str(exc.value)
    ok = resolve_shapes(load_config(None, ["model.arch=voxtral", "data.n_mels=128"]))
    assert ok.data.n_mels == 128


def test_the_local_checkpoints_config_wins_over_the_registry(local_whisper_llama, tmp_path):
    enc = local_whisper_llama / "whisper"
    overrides = ["model.arch=whisper-tinyllama", f"model.encoder_path={enc}"]
    assert resolve_shapes(load_config(None, overrides)).data.n_mels == 80  # the stand-in's
    with pytest.raises(ConfigError, match=rf"got 128.*takes 80 mel bins \({enc}/config.json\)"):
        resolve_shapes(load_config(None, [*overrides, "data.n_mels=128"]))
    vox = save_voxtral(tmp_path / "vox")  # encoder inside the one checkpoint: audio_config
    cfg = load_config(None, ["model.arch=voxtral", f"model.decoder_path={vox}"])
    assert feature_shape(cfg.model).n_mels == 80
    assert feature_shape(cfg.model).max_frames == 1000  # 2 x max_source_positions 500


def test_a_checkpoint_whose_extractor_differs_is_refused(local_whisper_llama, tmp_path):
    import shutil

    from cluster_fl.engine.setup import check_extractor

    enc = tmp_path / "whisper"
    shutil.copytree(local_whisper_llama / "whisper", enc)
    model_cfg = load_config(None, ["model.arch=whisper-tinyllama",
                                   f"model.encoder_path={enc}"]).model
    check_extractor(model_cfg)  # no preprocessor_config.json: Whisper's extractor
    (enc / "preprocessor_config.json").write_text(json.dumps(
        {"feature_size": 80, "sampling_rate": 8000, "hop_length": 160, "n_fft": 400}))
    with pytest.raises(UserError, match="sampling_rate 8000.*computed with 16000"):
        check_extractor(model_cfg)
    (enc / "preprocessor_config.json").write_text(json.dumps({"feature_size": 128}))
    with pytest.raises(UserError, match="feature_size 128 contradicts .*num_mel_bins 80"):
        feature_shape(model_cfg)


def test_features_are_never_computed_with_an_unresolved_n_mels(tiny_corpus):
    from cluster_fl.data import FeatureStore

    cfg = load_config(None, [f"data.corpus={tiny_corpus}"])
    assert cfg.data.n_mels == 0
    with pytest.raises(ValueError, match="resolve"):
        FeatureStore.from_config(cfg.data)
    assert FeatureStore.from_config(resolve_shapes(cfg).data).n_mels == 80


def test_a_tokenizer_larger_than_the_decoders_vocabulary_is_refused(local_whisper_llama,
                                                                   tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from cluster_fl.models import build_base

    small = tmp_path / "llama12"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, intermediate_size=128,
                                 vocab_size=12)).save_pretrained(small)
    cfg = load_config(None, ["model.arch=whisper-tinyllama",
                             f"model.encoder_path={local_whisper_llama / 'whisper'}",
                             f"model.decoder_path={small}",
                             f"model.tokenizer_path={local_whisper_llama / 'llama'}"]).model
    with pytest.raises(UserError, match="has 13 tokens .*vocabulary 12 rows"):
        build_base(cfg)


def test_the_cli_refuses_80_mel_bins_for_whisper_large_v3_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "cluster_fl", "train",
                           str(ROOT / "configs" / "arch" / "whisper-tinyllama.yaml"),
                           "data.n_mels=80"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.n_mels" in lines[0]
    assert "80" in lines[0] and "128" in lines[0]


def test_a_grid_cell_that_contradicts_its_model_is_refused_before_submission():
    from cluster_fl.sweep.gridspec import expand, load_grid

    grid = load_grid(ROOT / "configs" / "grids" / "paper.yaml")
    specs = expand(grid)
    assert {s.config.data.n_mels for s in specs} == {128}
    with pytest.raises(ConfigError, match=r"in cell whisper-tinyllama__frozen__fedavg: .*got 80"):
        expand(grid, {"data.n_mels": 80})
