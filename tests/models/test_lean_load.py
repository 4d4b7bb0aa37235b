"""The lean load path: a real architecture is built on the meta device
and its tensors are read from safetensors (``safe_open(...).get_slice``) straight into memory
allocated once in the run's dtype, chunk by chunk -- never the Whisper decoder, never a whole
tensor in the file's dtype beside its cast copy -- and equals Hugging Face's ``from_pretrained``.
Random init is a decision: ``model.init``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_checkpoints import from_pretrained_model, save_whisper_llama

from cluster_fl.config import ConfigError, ModelConfig
from cluster_fl.errors import UserError
from cluster_fl.models import weights as weights_mod


@pytest.fixture(scope="module")
def bf16_files(tmp_path_factory):
    return save_whisper_llama(tmp_path_factory.mktemp("hf"), dtype=torch.bfloat16)


def _cfg(root, **kw) -> ModelConfig:
    return ModelConfig(arch="whisper-tinyllama", encoder_path=str(root / "whisper"),
                       decoder_path=str(root / "llama"), lora_rank=2, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bf16_files_load_chunk_by_chunk_as_from_pretrained_does(bf16_files, monkeypatch, dtype):
    from cluster_fl.distributed.parallelize import parallelize
    from cluster_fl.models import build_model

    monkeypatch.setattr(weights_mod, "CHUNK_BYTES", 256)  # many chunks per tensor
    keys: list[tuple[str, str]] = []
    whole_reads: list[str] = []
    into, read = weights_mod.SafetensorsFile.read_into, weights_mod.SafetensorsFile.read

    def read_into(self, key, out, start=0):
        keys.append((self.path.parent.name, key))
        assert out.dtype == getattr(torch, dtype)  # allocated once, in the run's dtype
        into(self, key, out, start)

    def read_whole(self, key, start=None, stop=None):
        whole_reads.append(key)
        return read(self, key, start, stop)

    monkeypatch.setattr(weights_mod.SafetensorsFile, "read_into", read_into)
    monkeypatch.setattr(weights_mod.SafetensorsFile, "read", read_whole)
    cfg = _cfg(bf16_files, dtype=dtype)
    torch.manual_seed(3)
    model = build_model(cfg, meta=True)
    parallelize(model, cfg, torch.device("cpu"))
    assert whole_reads == []  # no tensor read whole into fresh memory beside its destination
    whisper = {k for where, k in keys if where == "whisper"}
    assert whisper and all(k.startswith("encoder.") for k in whisper)  # never the decoder
    reference = from_pretrained_model(cfg, seed=3)
    parallelize(reference, cfg, torch.device("cpu"))
    want = dict(reference.named_parameters())
    got = dict(model.named_parameters())
    assert want.keys() == got.keys()
    assert [n for n in want if not torch.equal(want[n], got[n])] == []
    assert {p.dtype for p in got.values() if not p.requires_grad} == {getattr(torch, dtype)}


def test_random_init_is_said_and_a_real_architecture_needs_it_on_purpose(bf16_files):
    from cluster_fl.models import build_model
    from cluster_fl.models.build import describe_init
    from cluster_fl.models.weights import RandomWeights

    assert "RANDOM INIT (no model.checkpoint)" in describe_init(ModelConfig())
    assert "RANDOM INIT (model.init=random)" in describe_init(
        ModelConfig(arch="whisper-tinyllama", init="random"))
    assert describe_init(_cfg(bf16_files)).startswith("base from ")
    with pytest.raises(UserError, match=r"whisper-tinyllama: set model.decoder_path.*model.init=random"):
        build_model(ModelConfig(arch="whisper-tinyllama"), meta=True)
    skeleton = build_model(ModelConfig(arch="whisper-tinyllama", init="random", lora_rank=2),
                           meta=True, depth=(1, 1))
    assert isinstance(skeleton.weights, RandomWeights)
    with pytest.raises(UserError, match="model.init=pretrained"):
        build_model(ModelConfig(init="pretrained"))
    with pytest.raises(ConfigError, match="model.init"):
        ModelConfig(arch="whisper-tinyllama", init="random", decoder_path="/x")
    with pytest.raises(ConfigError, match="allowed: auto, pretrained, random"):
        ModelConfig(init="scratch")


def test_deepspeed_is_no_longer_a_shard_choice():
    with pytest.raises(ConfigError, match=r"model.shard.*allowed: none, fsdp2"):
        ModelConfig(shard="deepspeed", shard_group_size=2)


def test_a_repository_name_is_read_from_the_local_hf_cache_never_downloaded(tmp_path,
                                                                             monkeypatch):
    import shutil

    from cluster_fl.models.weights import checkpoint_folder

    src = save_whisper_llama(tmp_path / "src")
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / ("a" * 40)
    shutil.copytree(src / "llama", snapshot)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    assert checkpoint_folder("acme/tiny-llama") == snapshot
    assert checkpoint_folder("acme/not-cached") == Path("acme/not-cached")
    assert checkpoint_folder(src / "whisper") == src / "whisper"
