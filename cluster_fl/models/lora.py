"""LoRA adaptation (PEFT) and the trainable-group view the engine and privacy core use.

LoRA goes on q/k/v of every encoder and decoder attention layer; the connector is trained fully;
everything else is frozen. Module patterns are anchored at ``encoder.`` and ``decoder.model.``,
so Voxtral's audio tower and LM are separated even though their layers share names. A
frozen-encoder model gets no encoder LoRA at all (not merely zero-lr LoRA), so it lists no
encoder groups.

Groups are one per LoRA A / B matrix and per connector weight / bias, named after the parameter
(``decoder.model.layers.0.self_attn.q_proj.lora_A``), in module order, which is stable for a
given architecture and config.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from cluster_fl.config import ModelConfig
from cluster_fl.groups import GroupSpec, groups_from_layout

_QKV = r"self_attn\.(q_proj|k_proj|v_proj)"
ENCODER_PATTERN = rf"encoder\.layers\.\d+\.{_QKV}"
DECODER_PATTERN = rf"decoder\.model\.layers\.\d+\.{_QKV}"
_ADAPTER = "default"


def lora_pattern(freeze_encoder: bool) -> str:
    """PEFT ``target_modules`` regex (full match) for the encoder and/or decoder q/k/v."""
    return DECODER_PATTERN if freeze_encoder else f"({ENCODER_PATTERN})|({DECODER_PATTERN})"


def apply_lora(model: nn.Module, model_cfg: ModelConfig) -> nn.Module:
    """Inject LoRA in place and set ``requires_grad``: LoRA + connector train, the rest is frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    for p in model.parameters():
        p.requires_grad_(False)
    config = LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha,
                        lora_dropout=model_cfg.lora_dropout,
                        target_modules=lora_pattern(model_cfg.freeze_encoder), bias="none")
    inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
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

class _PerLearner(nn.Module):
    """Runs a module once per learner on that learner's contiguous rows, with its own weights."""

    def __init__(self, inner: nn.Module, stacks: Mapping[str, torch.Tensor], splits: Sequence[int]):
        super().__init__()
        self.inner = inner
        self.stacks = dict(stacks)  # local parameter name -> (K, *shape)
        self.splits = list(splits)
        self.stack = getattr(inner, "stack", None)  # the connector's frame stacking

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        per = {name: t.unbind(0) for name, t in self.stacks.items()}
        for k, n in enumerate(self.splits):
            if n:
                weights = {name: ts[k] for name, ts in per.items()}
                outs.append(torch.func.functional_call(self.inner, weights, (x[start:start + n],)))
            start += n
        return torch.cat(outs)


def _lora_hook(a: torch.Tensor, b: torch.Tensor, splits: Sequence[int], scaling: float,
               dropout: nn.Module):
    """Forward hook adding each learner's LoRA term ``B_k A_k x`` to its rows of the
    (adapter-disabled) base output: one batched matmul over learners when every active learner
    has the same number of rows (the common case: full batches), else one matmul per learner."""
    active = [k for k, n in enumerate(splits) if n]
    equal = len({splits[k] for k in active}) == 1
    index = torch.tensor(active, device=a.device)
    full = len(active) == len(splits)

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = dropout(args[0].to(a.dtype))
        if equal:
            a_k = a if full else a.index_select(0, index)
            b_k = b if full else b.index_select(0, index)
            xs = x.reshape(len(active), -1, x.shape[-1])  # (learners, rows x positions, in)
            delta = torch.bmm(torch.bmm(xs, a_k.transpose(1, 2)), b_k.transpose(1, 2))
            delta = delta.reshape(*x.shape[:-1], delta.shape[-1])
        else:  # unbind: one gradient scatter for all learners, not one full-size zero each
            parts, start = [], 0
            a_k, b_k = a.unbind(0), b.unbind(0)
            for k, n in enumerate(splits):
                if n:
                    parts.append(x[start:start + n] @ a_k[k].t() @ b_k[k].t())
                start += n
            delta = torch.cat(parts)
        return out + (delta * scaling).to(out.dtype)

    return hook


@contextmanager
def stacked_trainables(model: nn.Module, stacks: Mapping[str, torch.Tensor],
                       splits: Sequence[int]) -> Iterator[None]:
    """Within the block, the model runs K learners at once on one batch.

    ``stacks`` maps every trainable group name to a ``(K, *shape)`` tensor (learner k's LoRA A/B
    and connector weights at index k); ``splits[k]`` is how many consecutive batch rows belong to
    learner k. Every LoRA layer adds ``B_k A_k x`` to the rows x of learner k, and the connector
    runs once per learner with that learner's weights (:func:`torch.func.functional_call`). The
    frozen base is shared; gradients land in the stacks only. The model's own trainable
    parameters are not used (adapters are disabled and the connector swapped out for the
    duration) and are restored on exit.
    """
    from peft.tuners.lora import LoraLayer

    params = dict(_trainable_params(model))
    missing = set(params) - set(stacks)
    if missing:
        raise KeyError(f"stacked_trainables: no stack for {sorted(missing)[:3]}")
    grads = {name: p.requires_grad for name, p in params.items()}
    handles, layers = [], []
    connector = model.connector
    try:
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or _ADAPTER not in module.lora_A:
                continue
            module.enable_adapters(False)  # the base output only; the hook adds each row's term
            layers.append(module)
            hook = _lora_hook(stacks[f"{name}.lora_A"], stacks[f"{name}.lora_B"], splits,
                              module.scaling[_ADAPTER], module.lora_dropout[_ADAPTER])
            handles.append(module.register_forward_hook(hook))
        local = {n[len("connector."):]: t for n, t in stacks.items() if n.startswith("connector.")}
        model.connector = _PerLearner(connector, local, splits)
        yield
    finally:
        model.connector = connector
        for h in handles:
            h.remove()
        for module in layers:
            module.enable_adapters(True)
        for name, p in params.items():
            p.requires_grad_(grads[name])
