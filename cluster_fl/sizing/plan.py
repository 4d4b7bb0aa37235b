"""``cluster-fl plan CONFIG --gpus N --gpu-memory GiB``: per-GPU memory of a config, before a job.

Owns the memory model of DESIGN §12. The world of N GPUs splits into N/G client lanes of G ranks
(``model.shard_group_size``); a lane trains one client at a time, the frozen base sharded over its
G ranks (FSDP2: one unit per encoder/decoder layer, the rest in the root unit), the trainable
state replicated, and each member running ⌈B/G⌉ of the B utterances of a batch. Per GPU::

    base        frozen parameters x bytes(model.dtype) / G
    gathered    (root unit x (G-1)/G + 2 x largest layer) x bytes(model.dtype)     (G > 1)
                the root unit (convolutions, positions, embeddings, norms, LM head) stays
                gathered through forward and backward; a layer is all-gathered into a buffer
                and copied out into its unsharded parameters (or computes while the next is
                prefetched): two whole layers. bench/lane_memory.py's CPU lane (211M, 12 x
                1024, 8 x 3 s, fp32; results/LOG.md, 2026-12-03) measured 1146 / 846 MiB per
                rank at G=2 without / with checkpointing; this model plans 1136 / 852
    trainable   P x 16 B: fp32 LoRA/connector master weights 4, gradients 4, AdamW moments 8
    buffers     P x 16 B: global state 4, update Δ 4, int64 fixed-point sum 8 (the cpu profile
                adds 24 B: rank 0's float64 decoded sum, noised sum and broadcast buffer live on
                the host); counted as if they coexisted with the training step, which Δ does
                not quite (an upper bound by 4 B/P)
    activations ⌈B/G⌉ x A, A = one utterance's activation peak (plain and checkpointed)
    overhead    profile.fixed + profile.slack x activations
    total       the sum; a G fits when total <= --gpu-memory

P = trainable parameters (LoRA on q/k/v + the connector), counted on the meta device
(``build_skeleton``), as are the frozen parameters and the units; nothing is loaded.

**Activations: measured on a narrow twin at plan time.** The twin is the configured model with
every width divided by f -- hidden sizes, attention and key/value heads (head size kept), FFN,
vocabulary, LoRA rank -- built with 1 or 2 encoder and decoder layers, zero weights (memory
depends on shapes only), and ``distributed.parallelize``'s own dtype policy (frozen base in
``model.dtype``, LoRA/connector fp32, autocast) and activation checkpointing (non-reentrant
``torch.utils.checkpoint`` around every encoder and decoder layer) for the checkpointed figure.
One utterance of ``--seconds`` audio and ``--text-tokens`` text runs forward and backward
through ``model.loss`` under :class:`PeakMeter`, which counts the bytes of every tensor storage
created meanwhile (parameters, the batch and pre-allocated gradients excluded) and keeps the
peak of three phases: forward, decoder backward, encoder backward. Each phase's peak is linear
in the layer counts (a layer adds its saved tensors, or with checkpointing its stored input), so
the measurements (1,1), (2,1), (1,2) give it at the real counts; A = f x the largest phase (with
checkpointing the peak moves between phases as layers are added, hence phases). Every per-token
tensor of a layer (hidden, FFN, q/k/v, per-head log-sum-exp, eager attention's heads x T²
probabilities) and the logits (vocabulary / f) shrink exactly by f, so the twin scales back
without a fitted constant; rotary tables and masks do not shrink and are negligible. Matmul,
convolution and fused-attention kernels are not computed (``skip_compute``): their outputs are
allocated at the shapes their meta kernels give and zero-filled -- with zero weights that is what
they compute, bar attention's log-sum-exp -- so a bf16 twin costs no bf16 arithmetic on a CPU
without bf16 units. The figures in the issue's unit -- bytes per token·hidden·layer -- are
reported from the slopes (bf16: ~26 encoder / ~36 decoder plain, 2 checkpointed).

Measuring at plan time (~1 s on one core, after the imports) rather than storing constants keeps
the estimate true to the model code as it is (a new saved tensor, a KV cache, an attention
implementation, a local config.json with other dimensions) instead of a table that goes stale
silently. The registry's ``-tiny`` variants are not the twin: they do not keep the real ratios
(voxtral-tiny's encoder FFN is 8x its width for the stacking connector, real Voxtral's 4x; other
GQA ratios). Measured with CPU autocast, whose op lists differ slightly from CUDA's; float16 is
measured as bfloat16 (same widths).

Device profiles. ``cuda`` is a stated estimate, not measured (no GPU here): CUDA context and
kernels ~0.6 GiB, NCCL communicators of the world and lane groups ~1 GiB, cuBLAS workspaces --
2 GiB -- plus 10% of the activations for the caching allocator's fragmentation. ``cpu``: the
peak RSS beyond the tensors was 188-222 MB in all eight rows of ``bench/plan_memory.py`` (two
models, fp32/bf16, +/- checkpointing), whatever the activations -- 200 MiB, no slack -- with
glibc's mmap threshold pinned; glibc's default keeps a further 150-470 MiB of freed blocks
(see the bench), which this profile does not promise to cover.

Not modelled: evaluation (greedy decoding without gradients, smaller than a training step), the
short-lived clipping copies and float64 server step after local training (no activations then;
<= 40 B/P), AdamW's foreach temporaries during ``step`` (after the activations are freed).

``--json`` (stable; more keys may appear): {"arch", "dtype", "activation_checkpointing", "device",
"gpus", "gpu_memory_bytes", "workload": {"batch_size", "seconds", "frames", "encoder_tokens",
"decoder_tokens", "text_tokens"}, "model": {"frozen_params", "trainable_params", "root_params",
"largest_layer_params", "encoder_layers", "decoder_layers"}, "activations": {"width_divisor",
"per_utterance_bytes": {"plain", "checkpointed"}, "bytes_per_token_hidden_layer": {"encoder":
{"plain", "checkpointed"}, "decoder": {...}}}, "rows": [{"group_size", "lanes",
"utterances_per_gpu", "base_bytes", "gathered_bytes", "trainable_bytes", "buffers_bytes", "plain":
{"activations_bytes", "overhead_bytes", "total_bytes", "fits"}, "checkpointed": {...}}],
"smallest": {"plain": {"group_size", "lanes"} | null, "checkpointed": ... | null}, "uses":
"plain"|"checkpointed" (the config's setting), "fits" (at that setting), "message"}; with
``--runs-per-gpu N`` (N > 1) also "pack": {"runs_per_gpu", "per_run_bytes" (the G = 1 total at
the config's setting), "total_bytes" (N x that), "fits"} -- N one-GPU runs, each its own process,
on one GPU (``resources.runs_per_gpu`` of a grid, checked the same way before submission).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from cluster_fl.config import Config, require_resolved
from cluster_fl.errors import UserError
from cluster_fl.precision import dtype_name
from cluster_fl.sizing.activations import (FRAMES_PER_SECOND, MODES, ModelShape, Workload,
                                                measure_activations, model_shape, width_divisor)

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TRAINABLE_BYTES_PER_PARAM = 16  # fp32 weight 4 + grad 4 + AdamW exp_avg 4 + exp_avg_sq 4
BUFFER_BYTES_PER_PARAM = 16     # global state 4 + update 4 + int64 sum 8
HOST_NOISE_BYTES_PER_PARAM = 24  # float64 decoded sum, noised sum, broadcast buffer (rank 0)


@dataclass(frozen=True)
class DeviceProfile:
    """Memory the tensors do not account for: a fixed part and a share of the activations."""

    name: str
    fixed_bytes: int
    slack: float  # allocator fragmentation, as a fraction of the activations
    host_noise: bool  # rank 0's float64 noise buffers live in this memory


PROFILES = {  # module docstring: cuda stated, cpu measured by bench/plan_memory.py
    "cuda": DeviceProfile("cuda", 2 * GIB, 0.10, host_noise=False),
    "cpu": DeviceProfile("cpu", 200 * 1024 ** 2, 0.0, host_noise=True),
}


@dataclass(frozen=True)
class Terms:
    """Per-GPU bytes of one lane size G, for one checkpointing setting."""

    group_size: int
    lanes: int
    utterances_per_gpu: int
    base: int
    gathered: int
    trainable: int
    buffers: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return (self.base + self.gathered + self.trainable + self.buffers + self.activations
                + self.overhead)


def estimate(shape: ModelShape, activation_bytes_per_utterance: int, *, dtype: str,
             group_size: int, gpus: int, batch_size: int,
             profile: DeviceProfile = PROFILES["cuda"]) -> Terms:
    """The per-GPU memory terms of a lane of ``group_size`` ranks (module docstring)."""
    width = DTYPE_BYTES[dtype]
    g = group_size
    gathered = 0
    if g > 1:  # the root unit stays whole; a layer's gather buffer and its unsharded copy
        gathered = (shape.root_params * (g - 1) // g + 2 * shape.largest_layer_params) * width
    buffers = BUFFER_BYTES_PER_PARAM + (HOST_NOISE_BYTES_PER_PARAM if profile.host_noise else 0)
    per_gpu = -(-batch_size // g)
    activations = per_gpu * activation_bytes_per_utterance
    return Terms(group_size=g, lanes=gpus // g, utterances_per_gpu=per_gpu,
                 base=shape.frozen_params * width // g, gathered=gathered,
                 trainable=shape.trainable_params * TRAINABLE_BYTES_PER_PARAM,
                 buffers=shape.trainable_params * buffers, activations=activations,
                 overhead=profile.fixed_bytes + int(profile.slack * activations))


def group_sizes(gpus: int) -> list[int]:
    """Candidate lane sizes: the powers of two that divide N, and N itself."""
    out, g = [], 1
    while g <= gpus:
        if gpus % g == 0:
            out.append(g)
        g *= 2
    return out if out[-1] == gpus else out + [gpus]


def plan(cfg: Config, gpus: int, gpu_memory_gib: float, seconds: float = 15.0,
         text_tokens: int = 64, device: str = "cuda", runs_per_gpu: int = 1) -> dict[str, Any]:
    """The ``plan --json`` object (module docstring) for ``cfg`` on ``gpus`` GPUs; with
    ``runs_per_gpu`` N > 1 also ``"pack"``: whether N one-GPU runs of ``cfg`` fit on one GPU
    (each its own process: N x the G = 1 total, overhead included)."""
    from cluster_fl.models import apply_lora, build_skeleton

    require_resolved(cfg, "plan")
    if gpus < 1:
        raise UserError(f"--gpus: got {gpus}; a plan needs at least one GPU")
    if not gpu_memory_gib > 0 or not math.isfinite(gpu_memory_gib):
        raise UserError(f"--gpu-memory: got {gpu_memory_gib}; give the GPU's memory in GiB (> 0)")
    if not seconds > 0 or not math.isfinite(seconds):
        raise UserError(f"--seconds: got {seconds}; an utterance lasts more than 0 s")
    if text_tokens < 1:
        raise UserError(f"--text-tokens: got {text_tokens}; a transcript has at least 1 token")
    if device not in PROFILES:
        raise UserError(f"--device: got {device!r}; allowed: {', '.join(PROFILES)}")
    t0 = time.perf_counter()
    skeleton = apply_lora(build_skeleton(cfg.model), cfg.model)
    shape = model_shape(skeleton)
    workload = Workload(cfg.fl.batch_size, seconds, text_tokens)
    acts = measure_activations(skeleton, cfg.model, shape, workload)
    capacity = int(gpu_memory_gib * GIB)
    rows = []
    base_dtype = dtype_name(cfg.model.dtype, "cuda")
    for g in group_sizes(gpus):
        row: dict[str, Any] = {}
        for mode in MODES:
            t = estimate(shape, acts[mode].per_utterance_bytes, dtype=base_dtype,
                         group_size=g, gpus=gpus, batch_size=cfg.fl.batch_size,
                         profile=PROFILES[device])
            row.update(group_size=g, lanes=t.lanes, utterances_per_gpu=t.utterances_per_gpu,
                       base_bytes=t.base, gathered_bytes=t.gathered,
                       trainable_bytes=t.trainable, buffers_bytes=t.buffers)
            row[mode] = {"activations_bytes": t.activations, "overhead_bytes": t.overhead,
                         "total_bytes": t.total, "fits": t.total <= capacity}
        rows.append(row)
    smallest = {mode: next(({"group_size": r["group_size"], "lanes": r["lanes"]}
                            for r in rows if r[mode]["fits"]), None) for mode in MODES}
    own = "checkpointed" if cfg.model.activation_checkpointing else "plain"
    enc_tokens, dec_tokens = workload.tokens(shape)
    out = {
        "arch": cfg.model.arch, "dtype": base_dtype,
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "shard": cfg.model.shard, "device": device, "gpus": gpus, "gpu_memory_bytes": capacity,
        "workload": {"batch_size": cfg.fl.batch_size, "seconds": seconds,
                     "frames": workload.frames(shape), "encoder_tokens": enc_tokens,
                     "decoder_tokens": dec_tokens, "text_tokens": text_tokens},
        "model": {"frozen_params": shape.frozen_params,
                  "trainable_params": shape.trainable_params, "root_params": shape.root_params,
                  "largest_layer_params": shape.largest_layer_params,
                  "encoder_layers": shape.encoder_layers, "decoder_layers": shape.decoder_layers},
        "activations": {
            "width_divisor": width_divisor(skeleton),
            "per_utterance_bytes": {m: acts[m].per_utterance_bytes for m in MODES},
            "bytes_per_token_hidden_layer": {
                "encoder": {m: round(acts[m].encoder_bytes_per_token_hidden_layer, 2)
                            for m in MODES},
                "decoder": {m: round(acts[m].decoder_bytes_per_token_hidden_layer, 2)
                            for m in MODES}}},
        "profile": {"fixed_bytes": PROFILES[device].fixed_bytes,
                    "slack": PROFILES[device].slack},
        "rows": rows, "smallest": smallest, "uses": own, "fits": smallest[own] is not None,
        "seconds_taken": round(time.perf_counter() - t0, 2),
    }
    out["message"] = _verdict(out)
    if runs_per_gpu > 1:
        one = rows[0][own]["total_bytes"]
        out["pack"] = {"runs_per_gpu": runs_per_gpu, "per_run_bytes": one,
                       "total_bytes": runs_per_gpu * one,
                       "fits": runs_per_gpu * one <= capacity}
    return out


def _verdict(r: dict[str, Any]) -> str:
    """One line: the smallest G for the config's setting, or why nothing fits."""
    own, other = r["uses"], "plain" if r["uses"] == "checkpointed" else "checkpointed"
    cap = r["gpu_memory_bytes"] / GIB
    best = r["smallest"][own]
    if best is not None:
        return (f"smallest G that fits {cap:g} GiB: G={best['group_size']}, {best['lanes']} "
                f"lane{'s' if best['lanes'] > 1 else ''} (clients trained in parallel)")
    least = min(row[own]["total_bytes"] for row in r["rows"]) / GIB
    hint = []
    if r["smallest"][other] is not None and own == "plain":
        hint.append(f"model.activation_checkpointing=true fits at G="
                    f"{r['smallest'][other]['group_size']}")
    if r["dtype"] == "float32":
        hint.append("model.dtype=bfloat16 halves the base")
    hint.append("or lower fl.batch_size / add GPUs")
    return (f"nothing fits: even the best lane needs {least:.1f} GiB per GPU > {cap:g} GiB; "
            + "; ".join(hint))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def format_plan(r: dict[str, Any]) -> str:
    """The human table: one row per lane size G, every term in GiB."""
    m, w, a = r["model"], r["workload"], r["activations"]
    width = DTYPE_BYTES[r["dtype"]]
    lines = [
        f"{r['arch']}: {_count(m['frozen_params'])} frozen ({r['dtype']}), "
        f"{_count(m['trainable_params'])} trainable (fp32 + AdamW); {r['gpus']} GPU"
        f"{'s' if r['gpus'] > 1 else ''} x {r['gpu_memory_bytes'] / GIB:g} GiB "
        f"({r['device']} profile)",
        f"batch: {w['batch_size']} x {w['seconds']:g} s = {w['frames']} frames -> "
        f"{w['encoder_tokens']} encoder tokens, {w['decoder_tokens']} decoder tokens "
        f"({w['text_tokens']} text)",
        f"activations per utterance: {a['per_utterance_bytes']['plain'] / GIB:.2f} GiB plain, "
        f"{a['per_utterance_bytes']['checkpointed'] / GIB:.2f} GiB checkpointed (narrow twin, "
        f"width / {a['width_divisor']}; bytes per token·hidden·layer: encoder "
        f"{a['bytes_per_token_hidden_layer']['encoder']['plain']:g} / "
        f"{a['bytes_per_token_hidden_layer']['encoder']['checkpointed']:g}, decoder "
        f"{a['bytes_per_token_hidden_layer']['decoder']['plain']:g} / "
        f"{a['bytes_per_token_hidden_layer']['decoder']['checkpointed']:g})",
        "",
        f"{'G':>4} {'lanes':>5} {'utt/GPU':>7} {'base':>6} {'gather':>6} {'train':>6} "
        f"{'buffers':>7} {'act':>6} {'act-ckpt':>8} {'total':>6} {'total-ckpt':>10}   GiB",
    ]
    for row in r["rows"]:
        p, c = row["plain"], row["checkpointed"]
        lines.append(
            f"{row['group_size']:>4} {row['lanes']:>5} {row['utterances_per_gpu']:>7} "
            f"{_gib(row['base_bytes']):>6} {_gib(row['gathered_bytes']):>6} "
            f"{_gib(row['trainable_bytes']):>6} {_gib(row['buffers_bytes']):>7} "
            f"{_gib(p['activations_bytes']):>6} {_gib(c['activations_bytes']):>8} "
            f"{_gib(p['total_bytes']) + ('' if p['fits'] else '!'):>6} "
            f"{_gib(c['total_bytes']) + ('' if c['fits'] else '!'):>10}")
    prof = r["profile"]
    lines += ["",
              f"totals include {prof['fixed_bytes'] / GIB:.1f} GiB fixed + {prof['slack']:.0%} of "
              f"the activations ({r['device']} overhead); '!' = over "
              f"{r['gpu_memory_bytes'] / GIB:g} GiB; base in {width} B/parameter",
              f"activation checkpointing: {'on' if r['activation_checkpointing'] else 'off'} "
              f"(model.activation_checkpointing)"]
    if w["frames"] < round(w["seconds"] * FRAMES_PER_SECOND):
        lines.append(f"utterances are cut to the encoder's window ({w['frames']} frames), as "
                     "SpeechLLM.encode does")
    if r["shard"] == "none" and len(r["rows"]) > 1:
        lines.append("rows with G > 1 assume model.shard=fsdp2 (the config says none)")
    lines.append(r["message"])
    pack = r.get("pack")
    if pack:
        lines.append(f"runs_per_gpu {pack['runs_per_gpu']}: {pack['runs_per_gpu']} x "
                     f"{pack['per_run_bytes'] / GIB:.2f} GiB = {pack['total_bytes'] / GIB:.2f} GiB "
                     + ("fits" if pack["fits"] else "does NOT fit")
                     + f" on one {r['gpu_memory_bytes'] / GIB:g} GiB GPU")
    return "\n".join(lines)
