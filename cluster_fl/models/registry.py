"""The architecture registry: name -> how to build the encoder, connector and decoder.

Each architecture has a real variant (weights from ``model.encoder_path`` / ``decoder_path``
via ``from_pretrained(local_files_only=True)``) and a ``-tiny`` variant built from configs with
random init for CPU. The real variants' dimensions are kept here so that trainable groups can be
listed on the meta device without any weights (``describe_groups``); a local config.json at the
given path, when present, takes precedence over these defaults.

**Shapes follow the model.** What the architecture fixes about its input -- the mel bins of the
log-mel features, and the extractor behind them (sample rate, hop, FFT size) -- is read from here
or from the local checkpoint (``config.json``, ``preprocessor_config.json``), never assumed:
:func:`feature_shape` says what the model takes and where that comes from, and
:func:`resolve_shapes` fills ``data.n_mels`` (0 = the model's) or refuses a config that
contradicts the model, naming both values. It reads JSON only (no torch), so a config is checked
when it is read, before anything is built or submitted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_fl.errors import UserError

if TYPE_CHECKING:
    from cluster_fl.config import Config, ModelConfig


@dataclass(frozen=True)
class ArchSpec:
    """Dimensions and kind of one registered architecture."""

    name: str
    family: str  # "whisper-llama" (encoder + stacking connector + Llama) or "voxtral"
    encoder: dict[str, Any]  # WhisperConfig / VoxtralEncoderConfig kwargs
    decoder: dict[str, Any]  # LlamaConfig kwargs
    stack: int  # frames stacked by the connector
    tiny: bool
    tokenizer: str = "char"  # "char" (tiny) or "hf"
    defaults: dict[str, str] = field(default_factory=dict)  # documented default HF names

    @property
    def n_mels(self) -> int:
        """Mel bins of the encoder's first convolution."""
        return int(self.encoder["num_mel_bins"])


# The spike's tiny model: Whisper 128-d x 3 layers, 4-frame stacking, Llama 192-d x 3 layers.
# Tiny variants use eager attention: at these sizes (T ~ 100, head dim 32) PyTorch's CPU
# flash-attention kernel costs more than the plain matmuls (bench/pretrain_step.py).
_TINY_ENCODER = dict(d_model=128, encoder_layers=3, encoder_attention_heads=4, encoder_ffn_dim=512,
                     num_mel_bins=80, max_source_positions=1500, attn_implementation="eager")
_TINY_DECODER = dict(hidden_size=192, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=4, intermediate_size=512, max_position_embeddings=1024,
                     tie_word_embeddings=True, attn_implementation="eager")
# Real dimensions (whisper-large-v3 encoder; TinyLlama-1.1B; EuroLLM-1.7B and -9B; Voxtral-Mini-3B).
_WHISPER_LARGE = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20,
                      encoder_ffn_dim=5120, num_mel_bins=128, max_source_positions=1500)
_TINYLLAMA = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                  max_position_embeddings=2048)
_EUROLLM = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                num_key_value_heads=8, intermediate_size=5632, vocab_size=128000,
                max_position_embeddings=4096)
# EuroLLM-9B: the same Llama layout, 42 layers of 4096 (GQA 32/8); sized by `cluster-fl plan`.
_EUROLLM_9B = dict(hidden_size=4096, num_hidden_layers=42, num_attention_heads=32,
                   num_key_value_heads=8, intermediate_size=12288, vocab_size=128000,
                   max_position_embeddings=4096)
_VOXTRAL_MINI_TEXT = dict(hidden_size=3072, num_hidden_layers=30, num_attention_heads=32,
                          num_key_value_heads=8, intermediate_size=8192, vocab_size=131072,
                          head_dim=128, max_position_embeddings=131072)

REGISTRY: dict[str, ArchSpec] = {
    "whisper-tinyllama": ArchSpec(
        "whisper-tinyllama", "whisper-llama", _WHISPER_LARGE, _TINYLLAMA, stack=4, tiny=False,
        tokenizer="hf", defaults={"encoder": "openai/whisper-large-v3",
                                  "decoder": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}),
    "whisper-eurollm": ArchSpec(
        "whisper-eurollm", "whisper-llama", _WHISPER_LARGE, _EUROLLM, stack=4, tiny=False,
        tokenizer="hf", defaults={"encoder": "openai/whisper-large-v3",
                                  "decoder": "utter-project/EuroLLM-1.7B"}),
    "whisper-eurollm-9b": ArchSpec(
        "whisper-eurollm-9b", "whisper-llama", _WHISPER_LARGE, _EUROLLM_9B, stack=4, tiny=False,
        tokenizer="hf", defaults={"encoder": "openai/whisper-large-v3",
                                  "decoder": "utter-project/EuroLLM-9B"}),
    "voxtral": ArchSpec(
        # Voxtral's projector stacks intermediate_size / d_model = 4 frames after a 2x conv,
        # then two linear layers ("deeper, higher compression" than the stacking connector).
        "voxtral", "voxtral", _WHISPER_LARGE, _VOXTRAL_MINI_TEXT, stack=4, tiny=False,
        tokenizer="hf", defaults={"encoder": "mistralai/Voxtral-Mini-3B-2507",
                                  "decoder": "mistralai/Voxtral-Mini-3B-2507"}),
    "whisper-tinyllama-tiny": ArchSpec(
        "whisper-tinyllama-tiny", "whisper-llama", _TINY_ENCODER, _TINY_DECODER, stack=4,
        tiny=True),
    # Same layout as TinyLlama's tiny twin but grouped-query attention like EuroLLM.
    "whisper-eurollm-tiny": ArchSpec(
        "whisper-eurollm-tiny", "whisper-llama", _TINY_ENCODER,
        {**_TINY_DECODER, "num_key_value_heads": 2}, stack=4, tiny=True),
    # Tiny Voxtral: 8-frame stacking (encoder ffn = 8 x d_model) and a two-layer projector.
    "voxtral-tiny": ArchSpec(
        "voxtral-tiny", "voxtral", {**_TINY_ENCODER, "encoder_ffn_dim": 1024},
        {**_TINY_DECODER, "num_key_value_heads": 2}, stack=8, tiny=True),
}


def get_arch(name: str) -> ArchSpec:
    """The registered architecture ``name`` (UserError naming the choices otherwise)."""
    if name not in REGISTRY:
        raise UserError(f"unknown model.arch {name!r}; registered: {', '.join(REGISTRY)}")
    return REGISTRY[name]


# ---- shapes that follow the model -----------------------------------------------------------

# Whisper's feature extractor, which every registered encoder (Whisper, Voxtral's audio tower) was
# trained with; a checkpoint's preprocessor_config.json may say otherwise (checked at build time
# against the extractor in cluster_fl.data.features, see cluster_fl.engine.setup).
WHISPER_EXTRACTOR = {"sampling_rate": 16000, "hop_length": 160, "n_fft": 400}


@dataclass(frozen=True)
class FeatureShape:
    """What a model's encoder takes: ``n_mels`` bins of log-mel frames, at most ``max_frames``
    of them (2 x max_source_positions: longer input is cut), from an extractor with these
    parameters. ``source`` says where the figures come from (a file, or the registry entry)."""

    n_mels: int
    max_frames: int
    sampling_rate: int
    hop_length: int
    n_fft: int
    source: str


def local_config(path: str | None, name: str = "config.json") -> dict[str, Any] | None:
    """A local checkpoint file's JSON (``config.json`` by default), or None when there is none."""
    if path is None:
        return None
    p = Path(path).expanduser() / name
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{p} is not readable JSON ({type(exc).__name__})") from None


def encoder_config_path(model_cfg: "ModelConfig") -> tuple[str | None, bool]:
    """(folder whose config.json describes the audio encoder, whether the encoder config is the
    ``audio_config`` section of it: Voxtral ships encoder and LM in one checkpoint)."""
    spec = get_arch(model_cfg.arch)
    if spec.tiny:
        return None, False
    if spec.family == "voxtral":
        return model_cfg.decoder_path or model_cfg.encoder_path, True
    return model_cfg.encoder_path, False


def feature_shape(model_cfg: "ModelConfig") -> FeatureShape:
    """The input the configured model takes: from the local checkpoint's config.json (and
    preprocessor_config.json) when there is one, else from the registry entry. Tiny variants --
    random init or a ``cluster-fl pretrain`` checkpoint of the same architecture -- take the
    registry's."""
    spec = get_arch(model_cfg.arch)
    enc = dict(spec.encoder)
    extractor = dict(WHISPER_EXTRACTOR)
    source = f"registry entry {spec.name}"
    folder, nested = encoder_config_path(model_cfg)
    local = local_config(folder)
    if local is not None:
        section = local.get("audio_config") if nested else local
        if isinstance(section, dict):
            enc.update({k: section[k] for k in ("num_mel_bins", "max_source_positions")
                        if k in section})
            source = str(Path(folder).expanduser() / "config.json")
    pre = local_config(folder, "preprocessor_config.json")
    n_mels = int(enc["num_mel_bins"])
    if pre is not None:
        extractor.update({k: int(pre[k]) for k in WHISPER_EXTRACTOR if k in pre})
        size = pre.get("feature_size")
        if size is not None and int(size) != n_mels:
            raise UserError(f"{Path(folder).expanduser()}: preprocessor_config.json's "
                            f"feature_size {size} contradicts config.json's num_mel_bins "
                            f"{n_mels}; the checkpoint is inconsistent")
    return FeatureShape(n_mels=n_mels, max_frames=2 * int(enc["max_source_positions"]),
                        source=source, **extractor)


def resolve_shapes(cfg: "Config") -> "Config":
    """``cfg`` with ``data.n_mels`` set from the model (0 = the model's), or a ConfigError when
    the config asks for other mel bins than the model takes, naming both values.

    Called at the entrance of a run and nowhere below it (tests/test_architecture.py holds the
    list): the command layer (``commands.load_checked``), a grid's expansion
    (``sweep.gridspec``) and the engine's ``run_training``; what the engine, data, models,
    pretraining, calibration and sizing receive is already resolved
    (``config.require_resolved``)."""
    from cluster_fl.config import ConfigError

    shape = feature_shape(cfg.model)
    asked = cfg.data.n_mels
    if asked == shape.n_mels:
        return cfg
    if asked:
        raise ConfigError("data.n_mels", f"got {asked}, but model.arch {cfg.model.arch} takes "
                          f"{shape.n_mels} mel bins ({shape.source}); leave data.n_mels out "
                          f"(0 = the model's) or set it to {shape.n_mels}")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, n_mels=shape.n_mels))
