"""Parallelism, precision and placement, applied from outside the single-device model code.

torchtitan's ``parallelize.py`` layout: the model files never mention devices, dtypes or ranks;
:func:`parallelize` takes a built :class:`~cluster_fl.models.SpeechLLM` (LoRA applied) and, in a
fixed order, applies

1. the **dtype policy** -- the frozen base is stored in ``model.dtype`` (fp32, bf16, fp16); the
   trainable groups (LoRA, connector) stay fp32 master weights, so AdamW, the update Δ, clipping
   and the fixed-point sum are fp32 or wider; compute runs under autocast (:meth:`Placement.compute`);
2. **device placement** -- ``run.device: cpu|cuda|auto``, each rank on ``cuda:LOCAL_RANK``;
3. **activation checkpointing** -- every encoder and decoder layer recomputes its activations in
   the backward pass (``model.activation_checkpointing``); parameter names do not change;
4. **sharding of a client lane** -- with ``model.shard_group_size`` G > 1 the world's ranks form
   world/G lanes (a 2-D mesh: lane × shard). The frozen base is sharded over the G ranks of a lane
   with FSDP2 ``fully_shard`` (one unit per encoder/decoder layer, the rest in the root unit;
   DeepSpeed ZeRO-3 was removed in favour of it, ARCHITECTURE.md says why). A real architecture
   arrives as a skeleton on the meta device (``models.build_model(meta=True)``): FSDP2 shards
   the skeleton, allocates each rank's shards and reads only those rows from the checkpoint
   (:func:`load_shards`): no rank holds the whole base on the host. The trainable groups are left out of the
   sharding and replicated, so Δ, clipping and the secure sum see
   whole tensors exactly as in an unsharded run. A lane trains one client at a time: each member
   runs its slice of every batch, the members' trainable gradients are summed over the lane and
   divided by the batch's token count (:meth:`Placement.backward`), which is the gradient of the
   whole batch's mean loss -- the unsharded step, within float tolerance.

Only this package imports ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as tdist
from torch import nn

from cluster_fl.errors import UserError
from cluster_fl.precision import run_precision



# The model the process boundary applies itself to: a cluster_fl.models SpeechLLM, duck-typed
# (``prepare``, ``row_loss_sums``, ``loss``, a skeleton's ``weights``) because dist/ sits below
# models/ and cannot import it.
SpeechModel = Any


def resolve_device(spec: str, local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    """``run.device`` -> this rank's device. ``cuda`` without a CUDA device is an error (never a
    silent CPU run); the index follows how the launcher handed out GPUs
    (:func:`~cluster_fl.distributed.launch.device_index`: ``cuda:LOCAL_RANK`` when every task sees the
    node's GPUs, ``cuda:0`` when each task has its own, ranks packed when they share)."""
    from cluster_fl.distributed.launch import device_index, visible_devices

    if spec not in ("cpu", "cuda", "auto"):
        raise UserError(f"run.device: got {spec!r}; allowed: cpu, cuda, auto")
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("run.device: cuda was asked for, but this process sees no CUDA device "
                        f"(CUDA_VISIBLE_DEVICES={visible_devices()!r}: did the job request a "
                        "GPU -- resources.gpus_per_task? -- and is torch a CUDA build? torch "
                        f"{torch.__version__})")
    index = device_index(local_rank, local_world_size, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@dataclass(frozen=True)
class LaneLayout:
    """How the world's ranks form client lanes: ``lanes`` = world / G lanes of G ranks. Ranks
    ``lane*G .. lane*G + G-1`` form lane ``lane``; its ``member`` 0 contributes the lane's
    clipped updates to the secure sum and its evaluation rows."""

    world_size: int
    group_size: int
    rank: int

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.world_size % self.group_size:
            raise UserError(f"model.shard_group_size: {self.group_size} does not divide the "
                            f"world size {self.world_size}; start a multiple of G ranks")

    @property
    def lanes(self) -> int:
        return self.world_size // self.group_size

    @property
    def lane(self) -> int:
        return self.rank // self.group_size

    @property
    def member(self) -> int:
        return self.rank % self.group_size

    @property
    def leader(self) -> bool:
        """True on the member that speaks for the lane (writes its sum and rows)."""
        return self.member == 0


class Placement:
    """Where and how a model computes: device, autocast dtype and the lane it belongs to.

    :meth:`compute` is the autocast context for forward passes; :meth:`backward` runs one
    training step's forward + backward for this rank's share of a batch and leaves the lane's
    summed, token-normalised gradient in the trainable parameters' ``.grad``.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, layout: LaneLayout,
                 lane_group: Any = None):
        self.device, self.dtype, self.layout, self.lane_group = device, dtype, layout, lane_group
        self.buckets: Any = None  # shape quanta of prepared steps (None: exact shapes)
        self.compiled_layers = 0  # layers running a compiled graph (``apply_compile``)

    @property
    def sharded(self) -> bool:
        return self.layout.group_size > 1

    def compute(self) -> contextlib.AbstractContextManager:
        """Autocast in the base dtype (nothing to do for an fp32 base)."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def row_losses(self, model: SpeechModel, step: Any) -> torch.Tensor:
        """Per-row transcript-loss sums of a prepared step (``model.prepare``), under autocast."""
        with self.compute():
            return model.row_loss_sums(step)

    def backward(self, model: SpeechModel, batch: Mapping[str, Any],
                 params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Forward + backward of the mean transcript-token loss of ``batch``; returns the loss
        (a detached 0-d tensor on the device: reading it is left to the caller, once).

        Unsharded: the model's own loss. In a lane of G: this member's slice of the batch, the
        sum of its token losses divided by the whole batch's token count (counted on the host
        from the transcripts), gradients summed over the lane in one all-reduce with the loss
        (so every member holds the gradient of the whole batch's mean loss). Neither path reads
        a value back from the device."""
        if not self.sharded:
            step = model.prepare(batch, self.buckets)
            loss = self.row_losses(model, step).sum() / max(step.token_count, 1)
            loss.backward()
            return loss.detach()
        part, real = _member_slice(batch, self.layout.member, self.layout.group_size)
        # the lane's token total is known on the host (every member holds the whole batch's
        # texts), so each member's loss is scaled before its backward and nothing is read back
        total = max(sum(model.target_counts(batch["texts"])), 1)
        step = model.prepare(part, self.buckets)
        local = self.row_losses(model, step).sum()
        if not real:  # a member without rows still runs FSDP's collectives, with weight 0
            local = local * 0.0
        (local / total).backward()
        grads = [p.grad for p in params.values() if p.grad is not None]
        # one all-reduce: the trainable gradients and the lane's mean loss, left on the device
        flat = torch.cat([g.reshape(-1).float() for g in grads]
                         + [local.detach().float().reshape(1) / total])
        tdist.all_reduce(flat, op=tdist.ReduceOp.SUM, group=self.lane_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat[-1]


def _member_slice(batch: Mapping[str, Any], member: int, size: int) -> tuple[dict, bool]:
    """Rows ``member::size`` of a batch; a member left without rows gets row 0 (weight 0)."""
    n = len(batch["texts"])
    rows = list(range(member, n, size))
    real = bool(rows)
    rows = rows or [0]
    index = torch.tensor(rows, dtype=torch.long)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, (list, tuple)) and len(value) == n:
            out[key] = [value[i] for i in rows]
        else:
            out[key] = value
    return out, real


# --------------------------------------------------------------------------- the steps

def apply_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen parameters -> ``dtype``; trainable parameters -> fp32 master weights. Buffers
    (rotary frequencies, ...) keep their own dtype, as ``from_pretrained`` leaves them."""
    for p in model.parameters():
        want = torch.float32 if p.requires_grad else dtype
        if p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)


def _layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: encoder layers, then decoder layers."""
    out: list[nn.Module] = []
    for path in ("encoder.layers", "decoder.model.layers"):
        mod: Any = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if mod is not None:
            out.extend(mod)
    return out


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every encoder/decoder layer in the backward pass (non-reentrant checkpoint).

    The layer's ``forward`` is wrapped on the instance, so module and parameter names -- the
    trainable group names -- are unchanged. Without gradients (evaluation) layers run as usual.
    Returns the number of layers wrapped."""
    from torch.utils.checkpoint import checkpoint

    layers = _layers(model)
    for layer in layers:
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                # a KV cache would be appended to again by the recomputation
                for key in ("cache", "past_key_values", "past_key_value"):
                    if kwargs.get(key) is not None:
                        raise ValueError(f"activation checkpointing with a KV cache ({key}); "
                                         "train with use_cache=False")
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        forward.activation_checkpointing = True  # type: ignore[attr-defined]
        layer.forward = forward
    return len(layers)


def apply_fsdp2(model: nn.Module, mesh: Any, device: torch.device) -> None:
    """Shard the frozen base over the lane's ranks: one FSDP2 unit per layer, the root unit for
    the rest (convolutions, embeddings, norms, head). Trainable parameters are ignored (kept
    whole and replicated on ``device``). The model is called through ``loss`` and
    ``audio_embeddings`` (greedy decoding starts with it), so those are registered as forward
    methods: the root's parameters are gathered before them."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    trainable = {p for p in model.parameters() if p.requires_grad}
    with torch.no_grad():
        for p in trainable:
            p.data = p.data.to(device)
    layers = _layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=trainable & set(layer.parameters()))
    fully_shard(model, mesh=mesh, ignored_params=trainable)
    if device.type == "cpu":
        # gloo's all-gathers block the CPU that would compute meanwhile: prefetching the next
        # layer in backward (FSDP2's default) overlaps nothing and holds a second unsharded
        # layer (bench/lane_memory.py). A unit that "prefetches" itself -- already gathered --
        # turns the default off.
        for layer in layers:
            layer.set_modules_to_backward_prefetch([layer])  # type: ignore[operator]  # FSDPModule
    if any(p.is_meta for p in model.parameters()):
        load_shards(model, device)
    for method in ("loss", "audio_embeddings"):
        register_fsdp_forward_method(model, method)
    # audio_embeddings returns views of the encoder states; FSDP2 warns that an in-place op on
    # such a view would skip its pre-backward hook. The model code never writes into them.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPSpeechLLM\) returned "
                            r"a view tensor")


def load_shards(model: SpeechModel, device: torch.device) -> None:
    """Materialise a meta skeleton sharded by FSDP2: allocate this rank's shards on ``device``
    and read into each only its rows of the checkpoint tensor (``model.weights``), so the
    rank's host memory holds its shard and one read buffer, never the whole base. The trainable
    parameters (not sharded, already on ``device``) keep their values; buffers are recomputed."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    saved = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in saved:
                p.copy_(saved[name])
            elif isinstance(p, DTensor):
                local = p.to_local()
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                                      p.placements)
                if local.numel():  # this rank's rows, straight into its shard
                    model.weights.read_into(name, local, offset[0])
            else:
                model.weights.read_into(name, p)
    model.weights.rebuild_buffers(model, device)


def lane_mesh(layout: LaneLayout, device: torch.device) -> Any:
    """The (lane, shard) device mesh; returns the ``shard`` sub-mesh of this rank's lane."""
    from torch.distributed.device_mesh import init_device_mesh

    if not tdist.is_initialized():
        raise UserError("model.shard_group_size > 1 needs a process group: start the run with "
                        "torchrun or srun (one process per rank)")
    mesh = init_device_mesh(device.type, (layout.lanes, layout.group_size),
                            mesh_dim_names=("lane", "shard"))
    return mesh["shard"]


def parallelize(model: SpeechModel, model_cfg: Any, device: torch.device,
                layout: LaneLayout | None = None,
                precision: tuple[torch.dtype, bool] | None = None) -> Placement:
    """Apply dtype, device, activation checkpointing, sharding and compilation to ``model`` (in
    place, in that order) and return its :class:`Placement`. ``model_cfg`` is a ``ModelConfig``;
    ``precision`` the run's (dtype, compiled) as :func:`~cluster_fl.precision.run_precision`
    derived it (derived here the same way when not given)."""
    layout = layout or LaneLayout(1, 1, 0)
    shard = model_cfg.shard if layout.group_size > 1 else "none"
    dtype, compiled = precision or run_precision(model_cfg.dtype, model_cfg.compile, device.type)
    apply_dtype(model, dtype)
    if shard == "none":
        if any(p.is_meta for p in model.parameters()):  # a skeleton, unsharded: read it whole,
            model.weights.materialise(model, device)     # each tensor once, on the device
        model.to(device)
    if model_cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    group = None
    if shard == "fsdp2":
        mesh = lane_mesh(layout, device)
        apply_fsdp2(model, mesh, device)
        group = mesh.get_group()
    placement = Placement(device, dtype, layout, group)
    if device.type == "cuda":  # fp32 matmuls (LoRA, the connector, an fp32 base) on tensor cores
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if compiled:
        apply_compile(model, placement)
    return placement


# Shapes of a compiled step are rounded up to these quanta (mel frames, decoder positions,
# transcript targets): frames to a multiple of the encoder's 2x downsampling times the
# connector's stacking, so the padded encoder output always stacks without a remainder.
STEP_BUCKETS = (32, 8, 8)


def apply_compile(model: nn.Module, placement: Placement) -> int:
    """Compile every encoder and decoder layer (inductor; torchtitan's per-block compile): each
    layer's forward, and its backward through AOTAutograd, with symbolic batch and lengths
    (``dynamic=True``), so a run compiles at most 6 graphs whatever its utterances (the first
    encoder layer, whose input needs no gradient, the other encoder layers and the decoder layers,
    each also specialised to a one-row batch; tests/engine/test_compiled_step.py), and inductor's
    on-disk cache serves later runs. Layers of one type share the compiled code; the glue between
    them (embeddings, the connector, the LM head on the targets) runs eagerly. Evaluation and
    decoding call the same compiled layers (no grad, so their own graphs: a decode compiles ~10
    more in a fresh process, served by the on-disk cache later). Prepared steps are rounded up to
    ``STEP_BUCKETS``. Returns the layers compiled."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # sizes that happen to be equal in the first batch must not become one symbol
    fx_config.use_duck_shape = False
    # a layer's Python floats (attention scaling, LoRA scaling, dropout, norm epsilon) are
    # constants; as symbols each became a float64 tensor made on the host at every call
    # (30 a step of the tiny model, counted by tests/host_syncs.py)
    torch._dynamo.config.specialize_float = True
    layers = _layers(model)
    for layer in layers:
        # the layer's forward, not its __call__: module hooks -- FSDP2's gathers and frees in a
        # sharded lane -- stay eager around the compiled graph (torchtitan's arrangement, without
        # a wrapper module that would rename the parameters)
        layer.forward = torch.compile(layer.forward, dynamic=True)
    placement.buckets = STEP_BUCKETS
    placement.compiled_layers = len(layers)
    return len(layers)
