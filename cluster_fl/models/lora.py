"""LoRA adaptation and the trainable-group view the engine and privacy core use.

LoRA goes on q/k/v of every encoder and decoder attention layer; the connector is trained fully;
everything else is frozen. Module patterns are anchored at ``encoder.`` and ``decoder.model.``,
so Voxtral's audio tower and LM are separated even though their layers share names. A
frozen-encoder model gets no encoder LoRA at all (not merely zero-lr LoRA), so it lists no
encoder groups.

:class:`LoRALinear` is PEFT's LoRA layer as this project needs it: the same parameter names
(``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``, ...), the same initialisation
drawn in the same order and the same scaling alpha/r (tests/models/test_lora.py checks it
against PEFT), so checkpoints and groups are unchanged -- with a forward written for speed: one
path for a single learner and for K learners at once (adapters stacked on a learner axis and
applied with two batched matmuls), no per-call adapter bookkeeping, no hooks. The connector's
linear layers are :class:`StackedLinear` for the same reason.

Groups are one per LoRA A / B matrix and per connector weight / bias, named after the parameter
(``decoder.model.layers.0.self_attn.q_proj.lora_A``), in module order, which is stable for a
given architecture and config.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from torch import nn

from cluster_fl.config import ModelConfig
from cluster_fl.groups import GroupSpec, groups_from_layout

_QKV = r"self_attn\.(q_proj|k_proj|v_proj)"
ENCODER_PATTERN = rf"encoder\.layers\.\d+\.{_QKV}"
DECODER_PATTERN = rf"decoder\.model\.layers\.\d+\.{_QKV}"
_ADAPTER = "default"


def lora_pattern(freeze_encoder: bool) -> str:
    """The regex (full match) of the module names that get LoRA: decoder (and encoder) q/k/v."""
    return DECODER_PATTERN if freeze_encoder else f"({ENCODER_PATTERN})|({DECODER_PATTERN})"


def _per_learner(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` (rows, ..., d) as (k, rows/k x ..., d): learner j's rows are the j-th contiguous
    block of rows, every learner with the same number of rows."""
    return x.reshape(k, -1, x.shape[-1])


class LoRALinear(nn.Module):
    """``y = base(x) + (alpha / r) * B A dropout(x)`` with PEFT's names, init and scaling.

    ``stack`` (None outside a block): ``(A, B)`` of shapes ``(K, r, in)`` and ``(K, out, r)``,
    learner k's adapter at index k; the input's rows are then K equal contiguous blocks, one per
    learner, and each block gets its own learner's term.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base
        # created on the base's device (meta for a skeleton) then re-initialised exactly as
        # PEFT does (same random draws, same order)
        dev = base.weight.device
        self.lora_A = nn.ModuleDict({_ADAPTER: nn.Linear(base.in_features, rank, bias=False,
                                                         device=dev)})
        self.lora_B = nn.ModuleDict({_ADAPTER: nn.Linear(rank, base.out_features, bias=False,
                                                         device=dev)})
        nn.init.kaiming_uniform_(self.lora_A[_ADAPTER].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[_ADAPTER].weight)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.stack: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def weight(self) -> torch.Tensor:  # modules that read q_proj.weight (dtype, shape) see the base
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        h = self.dropout(x)
        if self.stack is None:
            delta = nn.functional.linear(nn.functional.linear(h, self.lora_A[_ADAPTER].weight),
                                         self.lora_B[_ADAPTER].weight)
        else:
            a, b = self.stack
            hk = _per_learner(h, a.shape[0])
            delta = torch.bmm(torch.bmm(hk, a.transpose(1, 2)), b.transpose(1, 2))
            delta = delta.reshape(*out.shape[:-1], delta.shape[-1])
        return out + (delta * self.scaling).to(out.dtype)


class StackedLinear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that can run K learners' weights at once:
    ``stack = (W (K, out, in), b (K, out) or None)``, rows in K equal contiguous blocks."""

    stack: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stack is None:
            return super().forward(x)
        w, b = self.stack
        xk = _per_learner(x, w.shape[0])
        y = torch.bmm(xk, w.transpose(1, 2)) if b is None else torch.baddbmm(
            b[:, None, :], xk, w.transpose(1, 2))
        return y.reshape(*x.shape[:-1], y.shape[-1])


def make_stackable(module: nn.Module) -> nn.Module:
    """Turn every ``nn.Linear`` inside ``module`` into a :class:`StackedLinear` sharing its
    parameters (names unchanged); returns ``module``."""
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            new = StackedLinear.__new__(StackedLinear)
            new.__dict__.update(child.__dict__)  # the same Parameter objects, hooks, flags
            setattr(module, name, new)
        else:
            make_stackable(child)
    return module


def apply_lora(model: nn.Module, model_cfg: ModelConfig) -> nn.Module:
    """Inject LoRA in place and set ``requires_grad``: LoRA + connector train, the rest is frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    pattern = re.compile(lora_pattern(model_cfg.freeze_encoder))
    targets = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and pattern.fullmatch(name)]
    for name in targets:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, LoRALinear(getattr(owner, child), model_cfg.lora_rank,
                                         model_cfg.lora_alpha, model_cfg.lora_dropout))
    make_stackable(model.connector)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.startswith("connector."))
    model.lora = {"rank": model_cfg.lora_rank, "alpha": model_cfg.lora_alpha,
                  "dropout": model_cfg.lora_dropout, "freeze_encoder": model_cfg.freeze_encoder}
    return model


def _group_name(param_name: str) -> str:
    # "...q_proj.lora_A.default.weight" -> "...q_proj.lora_A"; connector names stay as they are.
    return param_name.replace(f".{_ADAPTER}.weight", "")


def _trainable_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad and (".lora_" in name or name.startswith("connector.")):
            out.append((_group_name(name), p))
    return out


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The live trainable parameters keyed by group name (for optimisers and in-place updates)."""
    return dict(_trainable_params(model))


def trainable_groups(model: nn.Module) -> list[GroupSpec]:
    """The trainable groups in stable order, with component and parameter count."""
    return [GroupSpec(name, name.split(".", 1)[0], p.numel(), tuple(p.shape))
            for name, p in _trainable_params(model)]


def get_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the trainable tensors keyed by group name."""
    return {name: p.detach().clone() for name, p in _trainable_params(model)}


def set_trainable(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` (keyed by group name; all groups required) into the model in place."""
    params = dict(_trainable_params(model))
    missing, extra = set(params) - set(values), set(values) - set(params)
    if missing or extra:
        raise KeyError(f"set_trainable: missing {sorted(missing)[:3]}, unknown {sorted(extra)[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(values[name].to(device=p.device, dtype=p.dtype))


def describe_groups(model_cfg: ModelConfig) -> list[GroupSpec]:
    """Trainable groups without weights: ``model.layout`` if given, else a meta-device skeleton."""
    if model_cfg.layout is not None:
        return groups_from_layout(model_cfg.layout)
    from cluster_fl.models.build import build_skeleton

    return trainable_groups(apply_lora(build_skeleton(model_cfg), model_cfg))


# ---- several learners in one forward ------------------------------------------------------------

@contextmanager
def stacked_trainables(model: nn.Module, stacks: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, the model runs K learners at once on one batch.

    ``stacks`` maps every trainable group name to a ``(K, *shape)`` tensor (learner k's LoRA A/B
    and connector weights at index k). The batch's rows must be K equal contiguous blocks,
    learner k's rows the k-th block (a learner with fewer rows is padded by the caller with rows
    that do not count in its loss). Every LoRA layer adds learner k's ``B_k A_k x`` to its rows
    and the connector's linear layers apply learner k's weights, each as one batched matmul over
    learners; the frozen base is shared and gradients land in the stacks only. The model's own
    trainable parameters are not used for the duration; the stacks are detached on exit.
    """
    params = dict(_trainable_params(model))
    missing = set(params) - set(stacks)
    if missing:
        raise KeyError(f"stacked_trainables: no stack for {sorted(missing)[:3]}")
    modules = dict(model.named_modules())
    wired: list[nn.Module] = []
    try:
        for name, module in modules.items():
            if isinstance(module, LoRALinear) and f"{name}.lora_A" in params:
                module.stack = (stacks[f"{name}.lora_A"], stacks[f"{name}.lora_B"])
                wired.append(module)
            elif isinstance(module, StackedLinear) and f"{name}.weight" in params:
                module.stack = (stacks[f"{name}.weight"], stacks.get(f"{name}.bias"))
                wired.append(module)
        yield
    finally:
        for module in wired:
            module.stack = None
