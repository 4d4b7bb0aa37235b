"""Host -> device copies that do not make the host wait.

A plain ``tensor.to(cuda)`` of pageable host memory (and ``torch.tensor(data, device=cuda)``)
synchronises: the host waits until the device's stream has caught up to the copy. Values the
host makes for the device -- a step's weights and indices, a batch's gather index, a block's
statistics, the round's released mean -- are instead copied from page-locked memory with
``non_blocking=True``: the copy is queued behind the device's work and the host goes on. The
page-locked buffer comes from torch's caching host allocator, which keeps it alive until the copy
has run. On a CPU both functions return their input (the host is the device).
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device`` without a wait (module docstring); a tensor already there as is."""
    device = torch.device(device)
    if host.device == device or device.type == "cpu":
        return host.to(device)
    if host.device.type != "cpu":  # device to device: queued on the stream anyway
        return host.to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)


def to_device_together(tensors: Sequence[torch.Tensor], device: torch.device | str
                       ) -> list[torch.Tensor]:
    """Every tensor of ``tensors`` on ``device``, those on the host in ONE copy per dtype
    (concatenated, page-locked, copied without a wait, split on the device), each flattened
    to 1-D; the values and dtypes are unchanged."""
    device = torch.device(device)
    out = [t.reshape(-1) for t in tensors]
    if device.type == "cpu":
        return [t.to(device) for t in out]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(out):
        if t.device.type == "cpu":
            by_dtype.setdefault(t.dtype, []).append(i)
        elif t.device != device:
            out[i] = t.to(device, non_blocking=True)
    for dtype, idx in by_dtype.items():
        moved = to_device(torch.cat([out[i] for i in idx]), device)
        for i, part in zip(idx, moved.split([out[i].numel() for i in idx])):
            out[i] = part
    return out
