"""Several clients in one step: K clients of a block train together over one frozen base.

Each client keeps what it has when trained alone -- its own LoRA and connector weights (stacked
on a client axis, index k = the block's k-th client), its own AdamW moments and step count, its
own learning-rate schedule and number of local steps, its own batch order from (seed, round,
client) -- while the forward and backward run once for the block: the block's batches are
concatenated row-wise (client k's rows contiguous), every LoRA layer adds row i's client's term
(:func:`cluster_fl.models.lora.stacked_trainables`) and the loss is the sum over clients of each
client's mean token loss, so client k's gradient is exactly the gradient of its own loss. A
client with fewer batches leaves the step when its batches end; from then on its weights, moments
and step count do not move.

Equal to training the clients one by one up to floating-point rounding: the same operations
run on differently shaped matrices (more rows, padding to the block's longest utterance), so
sums are accumulated in another order (tests/engine/test_batched.py states the tolerance).
Dropout, when configured, draws from (seed, round, block) rather than per client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from cluster_fl.models.lora import stacked_trainables
from cluster_fl.models.speech_llm import host_list
from cluster_fl.seeding import derive_seed, generator
from cluster_fl.transfer import to_device

_BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, as the one-client path uses
_EPS = 1e-8


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` then cosine decay to 0 at ``total`` steps."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def local_steps(n_items: int, batch_size: int, local_epochs: int, max_local_steps: int) -> int:
    """Optimiser steps a client with ``n_items`` examples takes in a round."""
    total = local_epochs * math.ceil(n_items / batch_size)
    return min(total, max_local_steps) if max_local_steps else total


def batch_stream(make_batches, items: Sequence[object], batch_size: int, total: int,
                 g: torch.Generator) -> Iterator[Any]:
    """The client's batches in the order the one-client loop draws them (passes until ``total``)."""
    step = 0
    while step < total:
        for batch in make_batches(items, batch_size, g):
            if step >= total:
                return
            yield batch
            step += 1


Row = tuple[int, int]  # (client's position in the block, row in its batch)


def learner_passes(active: Sequence[int], rows: int, rows_per_pass: int) -> list[list[int]]:
    """The step's active learners cut into forward/backward passes of whole learners (each
    learner's ``rows`` rows stay in one pass, as the stacked matmuls need); ``rows_per_pass``
    bounds a pass's rows (0: one pass; a pass always holds at least one learner)."""
    per = len(active) if not rows_per_pass else max(1, rows_per_pass // max(1, rows))
    return [list(active[i:i + per]) for i in range(0, len(active), per)]


def gather_rows(parts: Mapping[int, Mapping[str, Any]], learners: Sequence[int],
                rows: int) -> tuple[dict[str, Any], list[bool]]:
    """One padded batch of the learners' batches, ``rows`` rows each (learner-major), and which
    rows are real: a learner with a short batch is filled up with copies of its first row,
    which weigh nothing in its loss (rows never interact in the model). The features stay on
    their device (two ops a learner); the lengths are read on the host."""
    real: list[bool] = []
    lengths: list[int] = []
    for j in learners:
        n = len(parts[j]["texts"])
        own = host_list(parts[j]["lengths"])
        lengths += own + [own[0]] * (rows - n)
        real += [True] * n + [False] * (rows - n)
    t_max = max(lengths)
    feats = []
    for j in learners:
        f = parts[j]["features"][..., :t_max]
        f = torch.nn.functional.pad(f, (0, t_max - f.shape[-1]))
        n = f.shape[0]
        feats.append(f if n == rows else torch.cat([f, f[:1].expand(rows - n, -1, -1)]))
    return ({"features": torch.cat(feats), "lengths": torch.tensor(lengths, dtype=torch.int64),
             "texts": [t for j in learners for t in _filled(parts[j]["texts"], rows)],
             "languages": [g for j in learners for g in _filled(parts[j]["languages"], rows)]},
            real)


def _filled(values: Sequence[Any], rows: int) -> list[Any]:
    """``values`` filled up to ``rows`` with copies of the first."""
    return list(values) + [values[0]] * (rows - len(values))


def _on_device(values: Sequence[float | int | bool], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """A small tensor of host values on ``device`` without a wait (``torch.tensor(...,
    device=cuda)`` would be a blocking copy)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


@dataclass
class BlockResult:
    """Per client of the block: Δ over the trainable groups, mean loss, steps taken."""

    deltas: list[dict[str, torch.Tensor]]
    losses: list[float]
    steps: list[int]


class StackedAdamW:
    """AdamW over ``(K, ...)`` stacks with a learning rate and step count per client.

    The update of client k is torch.optim.AdamW's single-tensor update with that client's
    learning rate and step; clients not in ``active`` are left exactly as they are (no decay, no
    moment update)."""

    def __init__(self, stacks: Mapping[str, torch.Tensor], lr_mult: Mapping[str, float],
                 weight_decay: float):
        self.stacks = stacks
        self.lr_mult = lr_mult
        self.weight_decay = weight_decay
        k = next(iter(stacks.values())).shape[0]
        dev = next(iter(stacks.values())).device
        self.m = {n: torch.zeros_like(t) for n, t in stacks.items() if lr_mult[n] > 0}
        self.v = {n: torch.zeros_like(t) for n, t in stacks.items() if lr_mult[n] > 0}
        self.t = torch.zeros(k, dtype=torch.float64, device=dev)

    @torch.no_grad()
    def step(self, lr: torch.Tensor, active: torch.Tensor) -> None:
        b1, b2 = _BETAS
        self.t += active.to(self.t.dtype)
        t = self.t.clamp(min=1)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        for name, p in self.stacks.items():
            if name not in self.m or p.grad is None:
                continue
            shape = (-1,) + (1,) * (p.dim() - 1)
            on = active.view(shape)
            lr_k = (lr * self.lr_mult[name]).to(p.dtype)
            g, m, v = p.grad, self.m[name], self.v[name]
            decayed = p * (1 - lr_k * self.weight_decay).view(shape)
            m_new = m.lerp(g, 1 - b1)
            v_new = v.mul(b2).addcmul(g, g, value=1 - b2)
            step_size = (lr_k / bc1.to(p.dtype)).view(shape)
            denom = (v_new.sqrt() / bc2.sqrt().to(p.dtype).view(shape)) + _EPS
            p.copy_(torch.where(on, decayed - step_size * (m_new / denom), p))
            m.copy_(torch.where(on, m_new, m))
            v.copy_(torch.where(on, v_new, v))


def train_block(runner: Any, block: Sequence[tuple[int, Sequence[object]]],
                global_state: Mapping[str, torch.Tensor], round_: int) -> BlockResult:
    """Train the block's clients together (see the module docstring); ``runner`` is the rank's
    :class:`~cluster_fl.engine.client.ClientRunner` (model, placement, configs, schedule)."""
    fl, ccfg, placement = runner.fl, runner.client_cfg, runner.placement
    k = len(block)
    dev = placement.device
    lr_mult = {name: runner.lr_mult(name) for name in runner.params}
    stacks = {name: global_state[name].to(device=dev, dtype=p.dtype).unsqueeze(0)
              .repeat(k, *([1] * p.dim())).requires_grad_(lr_mult[name] > 0)
              for name, p in runner.params.items()}
    opt = StackedAdamW(stacks, lr_mult, ccfg.weight_decay)
    totals = [local_steps(len(items), fl.batch_size, fl.local_epochs, fl.max_local_steps)
              for _, items in block]
    streams = [batch_stream(runner.make_batches, items, fl.batch_size, totals[j],
                            generator(runner.seed, "client-batches", round_, client))
               for j, (client, items) in enumerate(block)]
    torch.manual_seed(derive_seed(runner.seed, "block-torch", round_, *[c for c, _ in block]))
    loss_sum = torch.zeros(k, dtype=torch.float64, device=dev)  # read once, at the end
    steps = [0] * k
    model = runner.model
    model.train()
    for s in range(max(totals, default=0)):
        active = [j for j in range(k) if s < totals[j]]
        parts = {j: next(streams[j]) for j in active}
        for t in stacks.values():
            t.grad = None
        # each client's loss is its mean over its tokens in this step: the divisor is known
        # before the forward (transcript tokens + eos), so passes can be summed
        n_tok = {j: float(sum(model.target_counts(parts[j]["texts"]))) for j in active}
        rows = max(len(parts[j]["texts"]) for j in active)
        for learners in learner_passes(active, rows, runner.rows_per_pass):
            batch, real = gather_rows(parts, learners, rows)
            owners = [j for j in learners for _ in range(rows)]
            # made on the host, copied without a wait: the rows' weights, the learners' index
            weight = _on_device([1.0 / n_tok[j] if r else 0.0 for j, r in zip(owners, real)],
                                torch.float32, dev)
            index = _on_device(learners, torch.int64, dev)
            mine = (stacks if len(learners) == k else
                    {name: t.index_select(0, index) for name, t in stacks.items()})
            step = model.prepare(batch, placement.buckets)
            if getattr(runner, "flop_counter", None) is not None:  # host lengths: no device read
                runner.flop_counter.count(host_list(batch["lengths"]), batch["texts"])
            with stacked_trainables(model, mine):
                sums = placement.row_losses(model, step)
                client_loss = (sums * weight.to(sums.dtype)).view(len(learners), rows).sum(1)
                client_loss.sum().backward()
            loss_sum.index_add_(0, index, client_loss.detach().double())
        on = _on_device([j in parts for j in range(k)], torch.bool, dev)
        if ccfg.max_grad_norm > 0:
            _clip_per_client([t for t in stacks.values() if t.grad is not None],
                             ccfg.max_grad_norm)
        lr = _on_device([lr_at(steps[j], totals[j], fl.lr, ccfg.warmup_steps) if j in parts
                         else 0.0 for j in range(k)], torch.float64, dev)
        opt.step(lr, on)
        for j in active:
            steps[j] += 1
    with torch.no_grad():
        deltas = [{name: (stacks[name][j] - global_state[name].to(stacks[name].device)).clone()
                   for name in stacks} for j in range(k)]
    losses = loss_sum.tolist()
    return BlockResult(deltas, [losses[j] / max(1, steps[j]) for j in range(k)], steps)


def _clip_per_client(stacks: Sequence[torch.Tensor], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ applied to each client's slice of the stacked gradients."""
    grads = [t.grad for t in stacks if t.grad is not None]
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads]).norm(dim=0)
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)))
