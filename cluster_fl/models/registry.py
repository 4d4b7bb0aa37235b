"""The architecture registry: name -> how to build the encoder, connector and decoder.

Each architecture has a real variant (weights from ``model.encoder_path`` / ``decoder_path``
via ``from_pretrained(local_files_only=True)``) and a ``-tiny`` variant built from configs with
random init for CPU. The real variants' dimensions are kept here so that trainable groups can be
listed on the meta device without any weights (``describe_groups``); a local config.json at the
given path, when present, takes precedence over these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster_fl.errors import UserError


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
