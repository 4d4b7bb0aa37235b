"""Building a :class:`SpeechLLM` from a registry entry: random-init tiny variants from configs,
and real variants as skeletons on the meta device whose tensors are read from local safetensors
checkpoints (never downloads) -- on the host here, or by each rank straight onto its device in
its dtype, only the tensors or rows it holds (``build_base(meta=True)``;
:mod:`cluster_fl.models.weights` reads the checkpoint, :mod:`cluster_fl.distributed.parallelize`
places the tensors and shards).

Weights a checkpoint does not hold -- LoRA, and the whisper-llama connector between a pretrained
encoder and a pretrained LLM -- are drawn by :func:`init_new_weights` from one seed taken from the
global RNG before anything is built, so a meta-built lane and a ``from_pretrained`` rank start
from the same values. (Tiny random-init variants keep their construction-time init: they are
always built whole, and their numerics are what the tests and the study's starting points pin.)
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from cluster_fl.config import ModelConfig
from cluster_fl.errors import UserError
from cluster_fl.models.registry import ArchSpec, get_arch, local_config
from cluster_fl.precision import resolve_compile, resolve_dtype
from cluster_fl.models.speech_llm import SpeechLLM, StackConnector, VoxtralConnector
from cluster_fl.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from cluster_fl.models.weights import CheckpointWeights, RandomWeights

log = logging.getLogger(__name__)


def _quiet_transformers() -> contextlib.AbstractContextManager:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()

    @contextlib.contextmanager
    def ctx():
        hf_logging.set_verbosity_error()
        try:
            yield
        finally:
            hf_logging.set_verbosity(level)
    return ctx()


def _configs(spec: ArchSpec, vocab_size: int | None, model_cfg: ModelConfig,
             depth: tuple[int, int] | None = None):
    """(encoder config, decoder LlamaConfig) from the registry, overridden by local config.json;
    ``depth`` = (encoder layers, decoder layers) cuts the stacks (shape-true smoke tests)."""
    from transformers import LlamaConfig, VoxtralEncoderConfig, WhisperConfig

    enc_kw, dec_kw = dict(spec.encoder), dict(spec.decoder)
    if not spec.tiny:
        local_enc, local_dec = (local_config(model_cfg.encoder_path),
                                local_config(model_cfg.decoder_path))
        if spec.family == "voxtral" and local_dec is not None:
            local_enc, local_dec = local_dec.get("audio_config"), local_dec.get("text_config")
        if local_enc is not None:
            enc_kw = {k: local_enc[k] for k in
                      ("d_model", "encoder_layers", "encoder_attention_heads",
                       "encoder_ffn_dim", "num_mel_bins", "max_source_positions",
                       "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "intermediate_size") if k in local_enc}
        if local_dec is not None:
            dec_kw = {k: v for k, v in local_dec.items() if k in LlamaConfig().to_dict()
                      and k not in ("architectures", "model_type", "transformers_version")}
    if vocab_size is not None:
        dec_kw["vocab_size"] = vocab_size
    if depth is not None:
        enc_kw["num_hidden_layers" if "num_hidden_layers" in enc_kw else "encoder_layers"] = depth[0]
        dec_kw["num_hidden_layers"] = depth[1]
    if spec.family == "voxtral":
        keys = {"d_model": "hidden_size", "encoder_layers": "num_hidden_layers",
                "encoder_attention_heads": "num_attention_heads",
                "encoder_ffn_dim": "intermediate_size"}
        enc_kw = {keys.get(k, k): v for k, v in enc_kw.items()}
        enc_cfg = VoxtralEncoderConfig(**enc_kw)
    else:
        enc_cfg = WhisperConfig(**enc_kw, decoder_layers=1, vocab_size=8, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return enc_cfg, LlamaConfig(**dec_kw)


def _tokenizer_for(spec: ArchSpec, model_cfg: ModelConfig) -> Tokenizer:
    if spec.tokenizer == "char":
        return CharTokenizer()
    path = model_cfg.tokenizer_path or model_cfg.decoder_path
    if path is None and model_cfg.init == "random":  # no checkpoint on purpose: characters
        return CharTokenizer()
    if path is None:
        raise UserError(f"model.arch {spec.name}: set model.decoder_path (and optionally "
                        "model.tokenizer_path) to a local checkpoint; nothing is downloaded "
                        "(model.init=random trains from random weights on purpose)")
    try:
        return HFTokenizer(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.arch {spec.name}: cannot load the tokenizer at {path} "
                        f"({exc.__class__.__name__}); nothing is downloaded") from None


def _assemble(spec: ArchSpec, enc_cfg, dec_cfg, tokenizer: Tokenizer,
              with_ctc: bool) -> SpeechLLM:
    """Random-init modules of the right shapes (also used on the meta device)."""
    from transformers import (LlamaForCausalLM, VoxtralConfig, VoxtralForConditionalGeneration)
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    if spec.family == "voxtral":
        vox = VoxtralForConditionalGeneration(VoxtralConfig(
            audio_config=enc_cfg.to_dict(), text_config=dec_cfg.to_dict(),
            attn_implementation=enc_cfg._attn_implementation))
        encoder = vox.model.audio_tower
        stack = enc_cfg.intermediate_size // enc_cfg.hidden_size
        connector = VoxtralConnector(stack, vox.model.multi_modal_projector)
        decoder = _shell(vox)
        d_enc = enc_cfg.hidden_size
    else:
        encoder = WhisperEncoder(enc_cfg)
        decoder = LlamaForCausalLM(dec_cfg)
        connector = StackConnector(spec.stack, enc_cfg.d_model, dec_cfg.hidden_size)
        d_enc = enc_cfg.d_model
    ctc = nn.Linear(d_enc, len(tokenizer)) if with_ctc else None
    return SpeechLLM(spec.name, encoder, connector, decoder, tokenizer, ctc)


def build_base(model_cfg: ModelConfig, tokenizer: Tokenizer | None = None, *,
               meta: bool = False, weights: Any = None,
               depth: tuple[int, int] | None = None,
               storage_dtype: torch.dtype | None = None) -> SpeechLLM:
    """The architecture without LoRA: random init (tiny) or pretrained weights (real).
    ``storage_dtype``: the run's base dtype (``precision.run_precision``), which a skeleton is
    allocated in; without it, ``model.dtype`` where the model would run by default.

    A real architecture is always built as a skeleton on the meta device at the dimensions of
    the local config.json, with ``model.weights`` -- the checkpoint's tensors by parameter name
    (:class:`~cluster_fl.models.weights.CheckpointWeights`; with ``model.init: random``, or
    ``weights`` given, e.g. :class:`~cluster_fl.models.weights.RandomWeights`), checked against
    the files' headers before anything is allocated. ``meta=True`` leaves it there for the
    process boundary to place (each rank reads only the tensors or rows it holds, on its device
    in its dtype: :func:`cluster_fl.distributed.parallelize.parallelize`); otherwise its tensors
    are read onto the host here, each allocated once in ``model.dtype``. Either way only the
    Whisper encoder's tensors are read, never its decoder's. ``depth`` = (encoder layers,
    decoder layers) cuts the stacks (shape-true smoke tests)."""
    spec = get_arch(model_cfg.arch)
    tokenizer = tokenizer or _tokenizer_for(spec, model_cfg)
    with _quiet_transformers():
        if spec.tiny:
            enc_cfg, dec_cfg = _configs(spec, len(tokenizer), model_cfg, depth)
            model = _assemble(spec, enc_cfg, dec_cfg, tokenizer, with_ctc=True)
            model.reset_positions()
            _scale_up_convs(model)
            return model
        enc_cfg, dec_cfg = _configs(spec, None, model_cfg, depth)
        with torch.device("meta"):
            model = _assemble(spec, enc_cfg, dec_cfg, tokenizer, with_ctc=False)
    if weights is None:
        weights = (RandomWeights(int(torch.randint(0, 2 ** 31, ())))
                   if model_cfg.init == "random" else checkpoint_weights(spec, model_cfg))
    model.weights = weights
    apply_storage_dtype(model, model_cfg, storage_dtype)
    model.weights.check(model)
    if not meta:
        materialise(model, "cpu")
    check_vocabulary(model, model_cfg)
    return model


def describe_init(model_cfg: ModelConfig) -> str:
    """Where a run's base weights come from, for the line it logs at its start: random init is
    said out loud."""
    spec = get_arch(model_cfg.arch)
    if model_cfg.checkpoint is not None:
        return f"base from model.checkpoint {model_cfg.checkpoint}"
    if model_cfg.init == "random" or spec.tiny:
        why = "model.init=random" if model_cfg.init == "random" else "no model.checkpoint"
        return f"base: RANDOM INIT ({why}); nothing pretrained is loaded"
    folders = sorted({p for p in (model_cfg.encoder_path, model_cfg.decoder_path) if p})
    return f"base from {', '.join(folders)}"


def checkpoint_weights(spec: ArchSpec, model_cfg: ModelConfig) -> CheckpointWeights:
    def need(path: str | None, key: str) -> str:
        if path is None:
            raise UserError(f"model.arch {spec.name} needs {key} (a local path; e.g. "
                            f"{spec.defaults.get(key.split('.')[-1].split('_')[0], '?')}), or "
                            "model.init=random to train from random weights on purpose")
        return path

    if spec.family == "voxtral":
        return CheckpointWeights("voxtral", {"decoder": need(
            model_cfg.decoder_path or model_cfg.encoder_path, "model.decoder_path")})
    return CheckpointWeights("whisper-llama", {
        "encoder": need(model_cfg.encoder_path, "model.encoder_path"),
        "decoder": need(model_cfg.decoder_path, "model.decoder_path")})


def _storage_dtype(model_cfg: ModelConfig) -> torch.dtype:
    """The frozen base's dtype where the model will run (a GPU when there is one)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_dtype(model_cfg.dtype, device, resolve_compile(model_cfg.compile, device))


def apply_storage_dtype(model: nn.Module, model_cfg: ModelConfig,
                        dtype: torch.dtype | None = None) -> None:
    """A meta skeleton's floating parameters in ``model.dtype`` (what ``from_pretrained(dtype=)``
    gives a loaded base), so a shard is allocated once in its final dtype."""
    dtype = dtype or _storage_dtype(model_cfg)
    for p in model.parameters():
        if p.is_meta and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def materialise(model: SpeechLLM, device: torch.device | str = "cpu") -> SpeechLLM:
    """An unsharded model from a meta skeleton: every meta parameter gets its whole tensor from
    ``model.weights`` on ``device`` and the buffers are rebuilt
    (:meth:`~cluster_fl.models.weights.SkeletonWeights.materialise`)."""
    model.weights.materialise(model, device)
    return model


def _is_new(name: str, model: SpeechLLM) -> bool:
    """A trainable weight no checkpoint holds: LoRA, or the whisper-llama stacking connector."""
    return ".lora_" in name or (name.startswith("connector.")
                                and isinstance(model.connector, StackConnector))


def init_new_weights(model: SpeechLLM, seed: int) -> None:
    """Initialise the weights no checkpoint holds from ``seed`` alone, whatever device path built
    the model: each LoRA A Kaiming-uniform (a = sqrt(5), PEFT's init), each LoRA B zero, the
    stacking connector as ``nn.Linear`` initialises itself; in parameter order, in fp32 (they are
    fp32 master weights whatever ``model.dtype``; PEFT would have made them in the base's dtype).
    Meta parameters among them (a meta skeleton) are allocated on the CPU; other trainable meta
    parameters (Voxtral's pretrained projector) are read whole from ``model.weights``."""
    import math

    g = torch.Generator().manual_seed(seed)
    named = dict(model.named_parameters())
    for name, p in named.items():
        if not p.requires_grad:
            continue
        if p.is_meta:
            module_name, key = name.rsplit(".", 1)
            module = model.get_submodule(module_name)
            # a pretrained trainable weight passes through the storage dtype, as it does when
            # from_pretrained loads it in model.dtype before it becomes an fp32 master
            value = (torch.empty(p.shape, dtype=torch.float32) if _is_new(name, model) else
                     model.weights.read(name).to(p.dtype).to(torch.float32))
            module._parameters[key] = nn.Parameter(value, requires_grad=True)
            p = module._parameters[key]
        if not _is_new(name, model):
            continue
        if p.dtype != torch.float32:
            p.data = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        with torch.no_grad():
            if ".lora_B" in name:
                p.zero_()
            elif p.dim() >= 2:
                nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=g)
            else:  # a connector bias: nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                fan_in = named[name[:-len("bias")] + "weight"].shape[1]
                bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
                nn.init.uniform_(p, -bound, bound, generator=g)


def check_vocabulary(model: SpeechLLM, model_cfg: ModelConfig) -> None:
    """Every id the tokenizer can produce has a row in the decoder's embedding table (a larger
    tokenizer than the checkpoint's vocabulary fails only when such an id first appears)."""
    tok = model.tokenizer
    rows = model.decoder.get_input_embeddings().num_embeddings
    top = max(len(tok) - 1, tok.pad_id, tok.bos_id, tok.eos_id)
    if top >= rows:
        where = model_cfg.tokenizer_path or model_cfg.decoder_path or "the tokenizer"
        raise UserError(f"model.tokenizer_path: {where} has {len(tok)} tokens (largest id "
                        f"{top}), the decoder's vocabulary {rows} rows; use the decoder's own "
                        "tokenizer")


def _shell(vox: nn.Module) -> nn.Module:
    """A LlamaForCausalLM-shaped holder of Voxtral's LM and head, built without new weights."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shell = LlamaForCausalLM(vox.config.text_config)
    shell.model, shell.lm_head = vox.model.language_model, vox.lm_head
    return shell


# HF's init (normal, std 0.02) leaves the random conv front-end's output ~30x below the
# sinusoidal positions, so the audio is a faint perturbation at the start of pretraining.
# PyTorch's default (Kaiming-uniform) init x3 lowered the CTC loss after 300 steps from 2.87 to
# 2.32 on the synthetic corpus (results/LOG.md, 2026-12-02).
CONV_INIT_GAIN = 3.0


def _scale_up_convs(model: nn.Module) -> None:
    """Re-initialise a random-init Whisper encoder's two convolutions (Kaiming-uniform x gain)."""
    enc = model.encoder
    for conv in (getattr(enc, "conv1", None), getattr(enc, "conv2", None)):
        if isinstance(conv, nn.Conv1d):
            conv.reset_parameters()
            with torch.no_grad():
                conv.weight.mul_(CONV_INIT_GAIN)


def build_skeleton(model_cfg: ModelConfig, depth: tuple[int, int] | None = None) -> SpeechLLM:
    """The architecture on the meta device (shapes only, no memory, no weights read)."""
    spec = get_arch(model_cfg.arch)
    vocab = len(CharTokenizer()) if spec.tokenizer == "char" else None
    tokenizer = CharTokenizer()  # only its size matters for the (tiny-only) CTC head
    with _quiet_transformers(), torch.device("meta"):
        enc_cfg, dec_cfg = _configs(spec, vocab, model_cfg, depth)
        return _assemble(spec, enc_cfg, dec_cfg, tokenizer, with_ctc=spec.tiny)
