"""Local training of a rank's clients: from the global trainable state to each client's update Δ.

A client's randomness (batch order, dropout) comes only from (seed, round, client id), so the
update does not depend on which rank trains it. The runner keeps one model per process -- the
frozen base is shared by every client it trains. ``fl.clients_per_step`` = 1: clients train one
after another, the trainable groups (LoRA + connector) reset to the global state before each.
K > 1: :meth:`ClientRunner.train_cohort` trains blocks of K clients in one batched step each
(:mod:`cluster_fl.engine.batched`); the blocks are formed by :func:`cluster_fl.engine.cohort.blocks`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from cluster_fl.config import ClientConfig, FLConfig
from cluster_fl.distributed.parallelize import LaneLayout, Placement
from cluster_fl.engine.batched import local_steps, lr_at, train_block
from cluster_fl.groups import GroupSpec
from cluster_fl.models.speech_llm import host_list
from cluster_fl.seeding import derive_seed, generator

TensorBatch = Mapping[str, object]  # features, lengths, texts, languages (one padded batch)
# (utterances, batch_size, generator) -> iterator over batches, one pass over the data
BatchFn = Callable[[Sequence[object], int, torch.Generator], Iterator[TensorBatch]]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def release_memory() -> None:
    """Hand freed heap back to the OS (glibc ``malloc_trim``)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def resident_bytes() -> int:
    """This process's resident set size now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class HeapTrimmer:
    """Trims the heap after a client only once the resident set has grown past a bound.

    Each client allocates and frees batches, activations and optimiser state; without any trim,
    glibc's arenas fragment and the resident set creeps up with the number of clients trained.
    Trimming after every client kept it flat but cost ~10% of a round (the freed pages are
    faulted back in by the next client). Here the resident set is read after each client (one
    small /proc read) and the heap trimmed only when it exceeds the level after the last trim by
    ``max(min_bytes, fraction x that level)``. Limitation: a client whose working set alone
    exceeds the bound still trims every time (89 trims in 96 clients on the peer bench's work, as
    costly as trimming always); a reference that keeps the working set (never lowered) avoided
    that but let the memory benchmark creep to 1.05-1.10x (goal 1.05).
    """

    def __init__(self, fraction: float = 0.02, min_bytes: int = 32 << 20):
        self.fraction = fraction
        self.min_bytes = min_bytes
        self.floor = 0
        self.trims = 0

    def after_client(self) -> None:
        rss = resident_bytes()
        if not rss:
            return
        if not self.floor:
            self.floor = rss
        if rss > self.floor + max(self.min_bytes, self.fraction * self.floor):
            release_memory()
            self.trims += 1
            self.floor = resident_bytes() or rss


@dataclass
class ClientUpdate:
    """What one client hands to its rank: Δ over the trainable groups, sample count, mean loss."""

    client: int
    delta: dict[str, torch.Tensor]
    n_samples: int
    loss: float
    steps: int


class ClientRunner:
    """Trains clients one after another on a single model instance."""

    def __init__(self, model: torch.nn.Module, params: Mapping[str, torch.nn.Parameter],
                 groups: Sequence[GroupSpec], fl: FLConfig, client: ClientConfig,
                 make_batches: BatchFn, seed: int, placement: Placement | None = None):
        self.model = model
        # device, autocast dtype and lane; the default is one CPU process in fp32
        self.placement = placement or Placement(torch.device("cpu"), torch.float32,
                                                LaneLayout(1, 1, 0))
        self.params = dict(params)
        self.groups = list(groups)
        self.fl = fl
        self.client_cfg = client
        self.make_batches = make_batches
        self.seed = seed
        self.rows_per_pass = fl.rows_per_pass
        self.flop_counter: Any = None  # engine/performance.py's estimate, set by the run
        mult = {"encoder": client.lr_encoder_mult, "connector": client.lr_connector_mult,
                "decoder": client.lr_decoder_mult}
        self._mult = {g.name: mult.get(g.component, 1.0) for g in self.groups}
        self._param_groups: dict[float, list[str]] = {}
        for g in self.groups:
            self._param_groups.setdefault(self._mult[g.name], []).append(g.name)

    def lr_mult(self, name: str) -> float:
        """The client learning-rate multiplier of group ``name`` (0 freezes it)."""
        return self._mult.get(name, 1.0)

    def _optimizer(self) -> torch.optim.Optimizer:
        groups = [{"params": [self.params[n] for n in names], "lr_mult": m}
                  for m, names in sorted(self._param_groups.items()) if m > 0]
        frozen = [n for m, names in self._param_groups.items() if m == 0 for n in names]
        for name in frozen:  # a zero multiplier freezes the component for this client
            self.params[name].requires_grad_(False)
        # fused: one kernel per group for all its tensors (CPU and CUDA), not ~12 small ops each
        return torch.optim.AdamW(groups, lr=self.fl.lr, weight_decay=self.client_cfg.weight_decay,
                                 fused=True)

    def load_global(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state[name])
                p.requires_grad_(True)

    def train(self, client: int, utterances: Sequence[object], global_state: Mapping[str, torch.Tensor],
              round_: int) -> ClientUpdate:
        """E local epochs of AdamW with cosine LR on ``utterances``; returns Δ = local − global."""
        self.load_global(global_state)
        torch.manual_seed(derive_seed(self.seed, "client-torch", round_, client))  # dropout
        g = generator(self.seed, "client-batches", round_, client)
        total = local_steps(len(utterances), self.fl.batch_size, self.fl.local_epochs,
                            self.fl.max_local_steps)
        opt = self._optimizer()
        self.model.train()
        step, loss_sum = 0, torch.zeros((), dtype=torch.float64, device=self.placement.device)
        while step < total:
            for batch in self.make_batches(utterances, self.fl.batch_size, g):
                if step >= total:
                    break
                lr = lr_at(step, total, self.fl.lr, self.client_cfg.warmup_steps)
                for pg in opt.param_groups:
                    pg["lr"] = lr * pg["lr_mult"]
                opt.zero_grad(set_to_none=True)
                loss = self.placement.backward(self.model, batch, self.params)
                if self.flop_counter is not None:
                    self._count_flops(batch)
                if self.client_cfg.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(
                        [p for p in self.params.values() if p.grad is not None],
                        self.client_cfg.max_grad_norm)
                opt.step()
                loss_sum = loss_sum + loss.to(loss_sum.device, torch.float64)  # read once, at the end
                step += 1
        with torch.no_grad():
            delta = {name: (p.detach() - global_state[name]).clone()
                     for name, p in self.params.items()}
        return ClientUpdate(client=client, delta=delta, n_samples=len(utterances),
                            loss=float(loss_sum) / max(1, step), steps=step)

    def _count_flops(self, batch: Any) -> None:
        """The step's estimated FLOPs, from host lengths only (a device tensor is not read)."""
        get = batch.get if isinstance(batch, Mapping) else (lambda k: getattr(batch, k, None))
        lengths, texts = get("lengths"), get("texts")
        if isinstance(lengths, torch.Tensor) and lengths.is_cpu and texts is not None:
            self.flop_counter.count(host_list(lengths), texts)  # through numpy: no sync

    def train_cohort(self, clients: Iterable[tuple[int, Sequence[object]]],
                     global_state: Mapping[str, torch.Tensor], round_: int) -> Iterator[ClientUpdate]:
        """Train one block of clients, yielding each update in the block's order.

        One client (or ``fl.clients_per_step`` = 1): :meth:`train`. Several: one batched step per
        local step for all of them (:func:`cluster_fl.engine.batched.train_block`)."""
        block = list(clients)
        if len(block) == 1:
            yield self.train(block[0][0], block[0][1], global_state, round_)
            return
        if self.placement.sharded:  # the config refuses it too (Config.__post_init__)
            raise ValueError("fl.clients_per_step > 1 needs model.shard_group_size: 1 (a lane of "
                             "G ranks trains one client at a time)")
        result = train_block(self, block, global_state, round_)
        for j, (client, utterances) in enumerate(block):
            yield ClientUpdate(client=client, delta=result.deltas[j], n_samples=len(utterances),
                               loss=result.losses[j], steps=result.steps[j])
