"""DeepSpeed ZeRO-3 sharding of a client lane's frozen base (``model.shard=deepspeed``).

The same contract as FSDP2 in :mod:`cluster_fl.distributed.parallelize`: the frozen base is partitioned
over the lane's ranks; the trainable groups (LoRA, connector) stay whole and replicated on every
member, so the runner's optimiser, the update Δ, clipping and the secure sum see ordinary tensors.

How: ``deepspeed.zero.Init(module=...)`` partitions every parameter over the lane's process
group; the trainable groups -- and the few frozen tensors the model code reads outside a forward
of their own module (the encoder's position table) -- are then marked persistent (and external,
which ZeRO's first, trace-building step also respects) and gathered once, so ZeRO never releases
them. ``DeepSpeedZeRoOffload`` (ZeRO-3 without a DeepSpeed
optimiser, as ``deepspeed.initialize`` builds it for inference) installs the hooks that gather a
module's partitioned weights before its forward and release them after. No DeepSpeed engine or
optimiser is involved: the lane's gradients are summed by :meth:`Placement.backward`.

Needs the ``deepspeed`` extra (``pip install -e '.[deepspeed]'``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from cluster_fl.errors import UserError

# frozen tensors that model code reads directly (not inside their module's forward)
_READ_OUTSIDE_FORWARD = ("encoder.embed_positions.weight",)


def _import_deepspeed(device: torch.device) -> Any:
    if device.type == "cpu":  # DeepSpeed otherwise probes for accelerators and warns
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise UserError("model.shard=deepspeed needs DeepSpeed: pip install -e '.[deepspeed]' "
                        "(or use model.shard=fsdp2)") from None
    return deepspeed


def _partition_skeleton(model: Any, group: Any, device: torch.device, config: dict,
                        deepspeed: Any) -> None:
    """A meta skeleton, partitioned one module at a time: the lane's first member reads the
    module's tensors from the checkpoint (``model.weights``), ``zero.Init`` broadcasts them over
    the lane and keeps each member's partition. Children come before their parents, so every
    module converts only its own parameters; a rank holds one module's whole tensors at most."""
    import torch.distributed as tdist

    reader = tdist.get_rank(group) == 0
    names = {id(p): n for n, p in model.named_parameters()}
    made: dict[int, nn.Parameter] = {}
    for _, module in reversed(list(model.named_modules())):
        own = [(k, p) for k, p in module._parameters.items() if p is not None and p.is_meta]
        if not own:
            continue
        for key, p in own:
            if id(p) not in made:
                value = (model.weights.read(names[id(p)]).to(device=device, dtype=p.dtype)
                         if reader else torch.empty(p.shape, dtype=p.dtype, device=device))
                made[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            module._parameters[key] = made[id(p)]
        deepspeed.zero.Init(module=module, data_parallel_group=group, config_dict_or_path=config)
    model.weights.rebuild_buffers(model, device)


def apply_zero3(model: nn.Module, group: Any, device: torch.device) -> Any:
    """Partition ``model``'s frozen base over ``group`` (the lane) with ZeRO-3; keep the trainable
    groups whole. Returns the hook owner (keep it alive with the model)."""
    deepspeed = _import_deepspeed(device)
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.utils.timer import NoopTimer

    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if any(p.is_meta for p in model.parameters()):
        _partition_skeleton(model, group, device, config, deepspeed)
    named = dict(model.named_parameters())
    keep = [p for p in named.values() if p.requires_grad]
    keep += [named[n] for n in _READ_OUTSIDE_FORWARD if n in named]
    for module in model.modules():  # buffers are not partitioned: they go to the device as-is
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    deepspeed.zero.Init(module=model, data_parallel_group=group, config_dict_or_path=config)
    for p in keep:
        # persistent: never partitioned again once gathered; "external": ZeRO's first-step
        # (trace-building) release path ignores ds_persist but skips external parameters
        p.ds_persist = True  # type: ignore[attr-defined]  # DeepSpeed's own attributes
        p.is_external_param = True  # type: ignore[attr-defined]
    hooks = DeepSpeedZeRoOffload(model, timers=NoopTimer(), ds_config=DeepSpeedConfig(config),
                                 param_persistence_threshold=0, dp_process_group=group)
    for p in keep:
        p.all_gather()  # type: ignore[attr-defined]  # added by deepspeed.zero.Init
    return hooks
