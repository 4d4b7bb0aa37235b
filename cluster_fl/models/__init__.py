"""Speech-LLMs (encoder -> connector -> LLM decoder): registry, LoRA groups, checkpoints, decoding.

Public API used by the engine and the privacy core::

    build_model(model_cfg, tokenizer=None) -> SpeechLLM
    trainable_groups(model) / get_trainable(model) / set_trainable(model, values)
    trainable_parameters(model) -> {group name: live nn.Parameter}
    describe_groups(model_cfg)            # meta device, no weights
    save_checkpoint(model, tokenizer, dir) / load_checkpoint(dir)
    model.loss(batch) -> (loss, n_tokens); greedy_decode(model, batch, max_new_tokens, cache)
"""

from cluster_fl.models.build import build_base, build_skeleton
from cluster_fl.models.checkpoint import build_model, load_checkpoint, read_meta, save_checkpoint
from cluster_fl.models.lora import (apply_lora, describe_groups, get_trainable, set_trainable,
                                    trainable_groups, trainable_parameters)
from cluster_fl.models.registry import REGISTRY, ArchSpec, get_arch
from cluster_fl.models.decoding import greedy_decode
from cluster_fl.models.speech_llm import Batch, SpeechLLM, as_batch, collate
from cluster_fl.models.tokenizer import CharTokenizer, load_tokenizer, fold_case_and_spaces

__all__ = [
    "REGISTRY", "ArchSpec", "Batch", "CharTokenizer", "SpeechLLM", "apply_lora", "as_batch",
    "build_base", "build_model", "build_skeleton", "collate", "describe_groups", "get_arch",
    "get_trainable", "greedy_decode", "load_checkpoint", "load_tokenizer", "fold_case_and_spaces",
    "read_meta", "save_checkpoint", "set_trainable", "trainable_groups",
    "trainable_parameters",
]
