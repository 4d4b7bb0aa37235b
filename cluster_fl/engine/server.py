"""The server step: apply the noised mean update to the global trainable state.

``fedavg`` adds ``server_lr × mean``; ``momentum`` and ``adam`` treat the negated mean as a
pseudo-gradient (Reddi et al. 2021). All arithmetic is float64 on identical inputs, so every rank
computes the same new state. The optimiser's state is part of the checkpoint.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cluster_fl.config import AggregationConfig
from cluster_fl.transfer import to_device_together


class ServerOptimizer:
    """Server-side update rule with a state that checkpoints and restores exactly."""

    def __init__(self, cfg: AggregationConfig):
        self.cfg = cfg
        self.state: dict[str, Any] = {"t": 0, "m": {}, "v": {}}

    def step(self, params: Mapping[str, torch.Tensor],
             mean_update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        lr = self.cfg.server_lr
        kind = self.cfg.server_optimizer
        self.state["t"] += 1
        out = {}
        # the noised mean arrives on the communicator's side (CPU); the state lives on the
        # model's device, and so does the optimiser state (a resumed one comes from CPU). The
        # mean crosses in one copy per device, without making the host wait
        names = list(params)
        moved: dict[str, torch.Tensor] = {}
        for dev in dict.fromkeys(params[n].device for n in names):
            mine = [n for n in names if params[n].device == dev]
            flat = to_device_together([mean_update[n] for n in mine], dev)
            moved.update({n: t.reshape(mean_update[n].shape) for n, t in zip(mine, flat)})
        for name, p in params.items():
            u = moved[name].to(dtype=torch.float64)
            for key in ("m", "v"):
                if name in self.state[key]:
                    self.state[key][name] = self.state[key][name].to(p.device)
            if kind == "momentum":
                m = self.state["m"].get(name, torch.zeros_like(u))
                m = self.cfg.server_momentum * m + u
                self.state["m"][name] = m
                u = m
            elif kind == "adam":
                b1, b2, eps, t = self.cfg.server_momentum, 0.99, 1e-8, self.state["t"]
                m = b1 * self.state["m"].get(name, torch.zeros_like(u)) + (1 - b1) * u
                v = b2 * self.state["v"].get(name, torch.zeros_like(u)) + (1 - b2) * u * u
                self.state["m"][name], self.state["v"][name] = m, v
                u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
            out[name] = (p.to(torch.float64) + lr * u).to(p.dtype)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.state["t"], "m": dict(self.state["m"]), "v": dict(self.state["v"])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = {"t": int(state["t"]), "m": dict(state["m"]), "v": dict(state["v"])}
