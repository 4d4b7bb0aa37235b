"""Activation memory of a training step, measured on a narrow twin of the model (for ``plan``).

The configured architecture is built on the meta device for its shapes (:func:`model_shape`);
activations are measured at plan time on a *twin* with every width divided by f (head size kept),
1-2 layers and zero weights, under the run's dtype policy and activation checkpointing as
:mod:`cluster_fl.distributed.parallelize` applies them, and scaled back to the real layer counts and
width (:func:`measure_activations`). Heavy kernels (matmul, convolution, attention) are not
computed: their outputs are allocated at the right shape and zero-filled, which is what they would
compute with zero weights. The method and its limits are described in
:mod:`cluster_fl.sizing.plan`.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, replace
from typing import Any, Iterator

from cluster_fl.config import ModelConfig

FRAMES_PER_SECOND = 100          # log-mel hop of 10 ms
PROMPT_TOKENS = 2                # bos + language token
TWIN_MIN_WIDTH = 256             # narrow the decoder no further than this


# ---- what the skeleton says ------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a model, from the meta device."""

    frozen_params: int
    trainable_params: int
    root_params: int  # frozen parameters outside the encoder/decoder layers (FSDP root unit)
    largest_layer_params: int
    encoder_layers: int
    decoder_layers: int
    encoder_width: int
    decoder_width: int
    stack: int
    max_frames: int


def layer_lists(model: Any) -> tuple[Any, Any]:
    """(encoder layers, decoder layers): the repeated blocks that are sharded and checkpointed."""
    return model.encoder.layers, model.decoder.model.layers


def model_shape(model: Any) -> ModelShape:
    """Counts of a :class:`~cluster_fl.models.SpeechLLM` with LoRA applied (any device)."""
    enc_layers, dec_layers = layer_lists(model)
    in_layers = {id(p) for layer in [*enc_layers, *dec_layers] for p in layer.parameters()}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    layer_sizes = [sum(p.numel() for p in layer.parameters() if not p.requires_grad)
                   for layer in [*enc_layers, *dec_layers]]
    return ModelShape(
        frozen_params=sum(p.numel() for p in frozen),
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        root_params=sum(p.numel() for p in frozen if id(p) not in in_layers),
        largest_layer_params=max(layer_sizes, default=0),
        encoder_layers=len(enc_layers), decoder_layers=len(dec_layers),
        encoder_width=getattr(model.encoder.config, "d_model", None)
        or model.encoder.config.hidden_size,
        decoder_width=model.decoder.config.hidden_size, stack=model.connector.stack,
        max_frames=2 * model.encoder.embed_positions.weight.shape[0])


@dataclass(frozen=True)
class Workload:
    """One batch of a client: B utterances of ``seconds`` audio and ``text_tokens`` text."""

    batch_size: int
    seconds: float
    text_tokens: int

    def frames(self, shape: ModelShape) -> int:
        """Log-mel frames, capped at the encoder's window (``SpeechLLM.encode`` truncates)."""
        return min(max(1, round(self.seconds * FRAMES_PER_SECOND)), shape.max_frames)

    def tokens(self, shape: ModelShape) -> tuple[int, int]:
        """(encoder tokens, decoder tokens) of one utterance."""
        enc = (self.frames(shape) - 1) // 2 + 1
        audio = -(-enc // shape.stack)
        return enc, audio + PROMPT_TOKENS + self.text_tokens


# ---- measuring activations ---------------------------------------------------------------------
class PeakMeter:
    """Peak bytes of tensor storages created while active, per phase (a TorchDispatchMode).

    An op's output storage counts when it is new: not one of the op's inputs (views, in-place
    and ``out=`` results share them) and not seen before; it stops counting when the storage is
    freed. Tensors that existed before (parameters, the batch) therefore never count."""

    def __init__(self, skip_compute: bool = False) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        meter = self

        heavy = _heavy_ops() if skip_compute else frozenset()

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = (_allocate_like(func, args, kwargs or {}) if func in heavy
                       else func(*args, **(kwargs or {})))
                seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        meter._track(t.untyped_storage(), seen)
                return out

        self._mode = _Mode()
        self.live = 0
        self.phase = "forward"
        self.peaks: dict[str, int] = {}
        self._refs: dict[int, Any] = {}

    def _track(self, storage: Any, inputs: set[int]) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in inputs or key in self._refs:
            return
        self.live += size
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.live)
        self._refs[key] = weakref.ref(storage, lambda _r, k=key, n=size: self._free(k, n))

    def _free(self, key: int, size: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= size

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), self.live)

    @contextlib.contextmanager
    def active(self) -> Iterator["PeakMeter"]:
        with self._mode:
            yield self


def _heavy_ops() -> frozenset:
    """Matmuls, convolutions and fused attention: the kernels whose cost is compute."""
    import torch

    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
             "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _allocate_like(func: Any, args: Any, kwargs: Any) -> Any:
    """``func``'s outputs at the shapes and strides its meta kernel gives, zero-filled."""
    import torch
    from torch.utils._pytree import tree_map_only

    meta = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    out = func(*meta[0], **meta[1])
    return tree_map_only(torch.Tensor, lambda m: torch.empty_strided(
        m.size(), m.stride(), dtype=m.dtype).zero_(), out)


PHASES = ("forward", "decoder", "encoder")
MODES = ("plain", "checkpointed")


@dataclass(frozen=True)
class ActivationCost:
    """One utterance's activation peak at the real layer counts, and the per-layer slopes."""

    per_utterance_bytes: int
    encoder_bytes_per_token_hidden_layer: float
    decoder_bytes_per_token_hidden_layer: float


def width_divisor(model: Any) -> int:
    """f: divides every head count; the largest power of two keeping the decoder >= 256 wide."""
    enc, dec = model.encoder.config, model.decoder.config
    enc_heads = enc.encoder_attention_heads if hasattr(enc, "d_model") else enc.num_attention_heads
    g = math.gcd(enc_heads, dec.num_attention_heads,
                 getattr(dec, "num_key_value_heads", None) or dec.num_attention_heads)
    f = 1
    while g % (2 * f) == 0 and dec.hidden_size // (2 * f) >= TWIN_MIN_WIDTH:
        f *= 2
    return f


def _narrow(value: int, f: int) -> int:
    return max(1, round(value / f))


def build_twin(model: Any, model_cfg: ModelConfig, f: int, layers: int = 2) -> Any:
    """The narrow twin of ``model`` (``layers`` encoder and decoder layers, zero weights, CPU)."""
    import torch
    from transformers import LlamaConfig

    from cluster_fl.models import CharTokenizer, apply_lora
    from cluster_fl.models.build import _assemble, _quiet_transformers
    from cluster_fl.models.registry import ArchSpec
    from cluster_fl.models.speech_llm import VoxtralConnector

    enc, dec = model.encoder.config, model.decoder.config
    e = enc.to_dict()
    if "d_model" in e:  # Whisper
        keys = ("d_model", "encoder_attention_heads", "encoder_ffn_dim", "encoder_layers")
    else:  # Voxtral's audio tower
        keys = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")
    e.update({k: _narrow(e[k], f) for k in keys[:3]}, **{keys[3]: layers})
    enc_cfg = type(enc).from_dict(e)
    d = dec.to_dict()
    head_dim = getattr(dec, "head_dim", None) or dec.hidden_size // dec.num_attention_heads
    kv = getattr(dec, "num_key_value_heads", None) or dec.num_attention_heads
    d.update(hidden_size=_narrow(dec.hidden_size, f), intermediate_size=_narrow(
        dec.intermediate_size, f), num_attention_heads=_narrow(dec.num_attention_heads, f),
        num_key_value_heads=_narrow(kv, f), head_dim=head_dim, num_hidden_layers=layers,
        vocab_size=max(_narrow(dec.vocab_size, f), len(CharTokenizer())))
    dec_cfg = LlamaConfig.from_dict({k: v for k, v in d.items() if k in LlamaConfig().to_dict()
                                     or k == "head_dim"})
    for cfg, src in ((enc_cfg, enc), (dec_cfg, dec)):
        cfg._attn_implementation = src._attn_implementation or "sdpa"
    family = "voxtral" if isinstance(model.connector, VoxtralConnector) else "whisper-llama"
    spec = ArchSpec("twin", family, {}, {}, stack=model.connector.stack, tiny=True)
    with _quiet_transformers(), torch.device("meta"):
        twin = _assemble(spec, enc_cfg, dec_cfg, CharTokenizer(), with_ctc=False)
    apply_lora(twin, replace(model_cfg, lora_rank=_narrow(model_cfg.lora_rank, f)))
    twin.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*twin.parameters(), *twin.buffers()]:
            t.zero_()
    return twin


@contextlib.contextmanager
def _layers(model: Any, n_enc: int, n_dec: int) -> Iterator[None]:
    """Run ``model`` with its first n_enc encoder and n_dec decoder layers."""
    from torch import nn

    enc_all, dec_all = layer_lists(model)
    lm = model.decoder.model
    saved = lm.config.num_hidden_layers
    model.encoder.layers = nn.ModuleList(list(enc_all)[:n_enc])
    lm.layers = nn.ModuleList(list(dec_all)[:n_dec])
    lm.config.num_hidden_layers = n_dec
    try:
        yield
    finally:
        model.encoder.layers, lm.layers = enc_all, dec_all
        lm.config.num_hidden_layers = saved


def measured_dtype(dtype_name: str) -> str:
    """The dtype a CPU measurement uses: float16 as bfloat16 (same widths, CPU autocast);
    ``auto`` as on a GPU (bfloat16), the device a plan is made for."""
    return "bfloat16" if dtype_name in ("float16", "auto") else dtype_name


def apply_policy(model: Any, dtype_name: str, checkpointing: bool) -> None:
    """The dtype policy and activation checkpointing exactly as ``distributed.parallelize`` applies
    them (frozen base in the dtype, trainable groups fp32; every layer checkpointed)."""
    import torch

    from cluster_fl.distributed.parallelize import apply_activation_checkpointing, apply_dtype

    apply_dtype(model, getattr(torch, measured_dtype(dtype_name)))
    if checkpointing:
        apply_activation_checkpointing(model)


def compute_context(dtype_name: str) -> contextlib.AbstractContextManager:
    """CPU autocast in the base dtype, as ``Placement.compute`` does on the run's device."""
    import torch

    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, measured_dtype(dtype_name)))


def random_batch(n_mels: int, frames: int, text_tokens: int, batch_size: int = 1) -> Any:
    """``batch_size`` utterances of ``frames`` log-mel frames and ``text_tokens`` characters."""
    import torch

    from cluster_fl.models import collate

    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(n_mels, frames, generator=g) for _ in range(batch_size)]
    return collate(feats, ["a" * text_tokens] * batch_size, ["en"] * batch_size)


def step_peaks(model: Any, batch: Any, dtype_name: str, skip_compute: bool = True
               ) -> dict[str, int]:
    """Peak bytes per phase of one forward + backward of ``model.loss`` (gradients excluded)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # the gradients are the trainable term, not activations
        p.grad = torch.zeros_like(p)
    meter = PeakMeter(skip_compute)

    def mark_encoder(_module: Any, _inputs: Any, out: Any) -> None:
        # the encoder output's gradient arrives when the decoder's backward is done
        if out.requires_grad:
            out.register_hook(lambda _grad: meter.enter("encoder"))

    hook = model.encoder.layer_norm.register_forward_hook(mark_encoder)
    model.train()
    try:
        with meter.active():
            with compute_context(dtype_name):
                loss, _ = model.loss(batch)
            meter.enter("decoder")
            loss.backward()
            del loss
    finally:
        hook.remove()
        for p in params:
            p.grad = None
    return {phase: meter.peaks.get(phase, 0) for phase in PHASES}


def _extrapolate(runs: dict[tuple[int, int], dict[str, int]], shape: ModelShape, f: int,
                 enc_tokens: int, dec_tokens: int) -> ActivationCost:
    """Each phase's peak is linear in the layer counts: from (1,1), (2,1), (1,2) to the model's
    counts; the largest phase, times f, is the utterance's activation peak. The per-layer
    figures are each component's largest slope (its layers' cost where they weigh most)."""
    peak, slope_e, slope_d = 0, 0, 0
    for phase in PHASES:
        base = runs[(1, 1)][phase]
        d_enc, d_dec = runs[(2, 1)][phase] - base, runs[(1, 2)][phase] - base
        peak = max(peak, base + (shape.encoder_layers - 1) * d_enc
                   + (shape.decoder_layers - 1) * d_dec)
        slope_e, slope_d = max(slope_e, d_enc), max(slope_d, d_dec)
    return ActivationCost(
        per_utterance_bytes=int(f * peak),
        encoder_bytes_per_token_hidden_layer=f * slope_e / (enc_tokens * shape.encoder_width),
        decoder_bytes_per_token_hidden_layer=f * slope_d / (dec_tokens * shape.decoder_width))


def measure_activations(model: Any, model_cfg: ModelConfig, shape: ModelShape,
                        workload: Workload) -> dict[str, ActivationCost]:
    """{"plain", "checkpointed"}: one utterance's activation cost, measured on the narrow twin."""
    import torch

    f = width_divisor(model)
    frames = workload.frames(shape)
    enc_tokens, dec_tokens = workload.tokens(shape)
    n_mels = model.encoder.conv1.in_channels
    batch = random_batch(n_mels, frames, workload.text_tokens)
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: a second thread costs more than it gives
    try:
        twin = build_twin(model, model_cfg, f)
        apply_policy(twin, model_cfg.dtype, checkpointing=False)
        for mode in MODES:
            if mode == "checkpointed":
                apply_policy(twin, model_cfg.dtype, checkpointing=True)
            runs = {}
            for counts in ((1, 1), (2, 1), (1, 2)):
                with _layers(twin, *counts):
                    runs[counts] = step_peaks(twin, batch, model_cfg.dtype)
            out[mode] = _extrapolate(runs, shape, f, enc_tokens, dec_tokens)
    finally:
        torch.set_num_threads(threads)
    return out


# ---- the arithmetic ------------------------------------------------------------------------------
