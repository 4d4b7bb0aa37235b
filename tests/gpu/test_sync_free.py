"""No host synchronisation inside a local step on a GPU (``-m gpu``; skipped without CUDA).

A round of the tiny model on CUDA (bf16 base, the CUDA default) -- eager, one client at a time,
client features resident; compiled, three clients per step, features streamed: every CUDA
synchronisation is counted with ``torch.cuda.set_sync_debug_mode("warn")`` (each one warns:
``.item()``/``.tolist()``, a copy to the host, a blocking copy from pageable host memory, a
``nonzero``...). Asserted, per block of the measured round (after a warm-up round of the same
cohort, so nothing is compiled or allocated for the first time while counting):

* its training -- every local step of its clients and the batches they draw: **1**, the block's
  losses read once when it has trained; so **0 per local step**, whatever the number of steps;
* its tail (clip, statistics, diagnostics, the secure sum's encoding and range check): **1**,
  the block's norms read once.

The round's other synchronisations (the secure sum's copy to the host for the all-reduce, the
server step) happen once a round, outside the blocks; their count is printed (``-s``), not
asserted. CPU runs count the same things without a GPU: tests/engine/test_host_syncs.py.
Written where no GPU was at hand: its first run is bench/gpu_check.sh's.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SYNC = "synchronizing CUDA operation"  # c10/cuda's warning under sync debug mode "warn"
PER_BLOCK_TRAINING, PER_TAIL = 1, 1
RUN = ["model.arch=whisper-tinyllama-tiny", "fl.rounds=2", "fl.sampling=fixed",
       "fl.clients_per_round=6", "fl.batch_size=2", "fl.max_local_steps=3",
       "eval.max_utterances=4", "eval.bootstrap=10", "eval.max_new_tokens=6", "run.threads=1",
       "privacy.noise_multiplier=0.5", "privacy.clipping=alpha-split",
       "privacy.inside_pool=ema", "privacy.ema_warmup_rounds=0",
       # plain fixed point: the same round can be run twice (masks would refuse a repeat)
       "aggregation.secure_sum=false"]


class SyncLog:
    """Every CUDA synchronisation while active, as the warnings sync debug mode gives."""

    def __init__(self) -> None:
        self.caught: list[warnings.WarningMessage] = []

    @property
    def n(self) -> int:
        return sum(SYNC in str(w.message) for w in self.caught)

    def where(self, start: int = 0) -> list[str]:
        return [f"{w.filename}:{w.lineno}" for w in self.caught[start:] if SYNC in str(w.message)]


@contextmanager
def counting_syncs() -> Iterator[SyncLog]:
    log = SyncLog()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.caught = caught
        torch.cuda.synchronize()  # nothing of before is waited for inside
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield log
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _world(tiny_corpus, out, *extra):
    from cluster_fl.config import load_config
    from cluster_fl.distributed import LocalComm
    from cluster_fl.engine import setup

    cfg = load_config(None, [f"data.corpus={tiny_corpus}", "data.languages=[en,de,fr]",
                             f"run.out={out}", "run.device=cuda", *RUN, *extra])
    return setup.build_world(cfg, LocalComm(), lambda m: None)


@pytest.mark.parametrize("extra", [
    ("model.compile=false", "fl.clients_per_step=1", "data.device_resident=true"),
    ("model.compile=true", "fl.clients_per_step=3", "data.device_resident=false"),
], ids=["eager-K1-resident", "compiled-K3-streamed"])
def test_a_round_on_cuda_synchronises_only_at_the_ends_of_its_blocks(tiny_corpus, tmp_path,
                                                                      extra):
    world = _world(tiny_corpus, tmp_path, *extra)
    engine, runner = world.engine, world.engine.runner
    assert engine.feeder is not None and engine.feeder.device.type == "cuda"
    engine.run_round(1, world.initial_state)  # warm-up: compile, allocate, make resident
    spans: dict[str, list[tuple[int, int, int]]] = {"training": [], "tail": []}
    train_cohort, contribute = runner.train_cohort, engine.contribute

    def counted_training(clients, global_state, round_):
        clients = list(clients)
        start = log.n
        updates = list(train_cohort(clients, global_state, round_))
        spans["training"].append((start, log.n, max(u.steps for u in updates)))
        yield from updates

    def counted_tail(round_, updates):
        start = log.n
        contribute(round_, updates)
        spans["tail"].append((start, log.n, len(updates)))

    runner.train_cohort, engine.contribute = counted_training, counted_tail
    try:
        with counting_syncs() as log:
            engine.run_round(1, world.initial_state)
    finally:
        del runner.train_cohort, engine.contribute
    assert spans["training"] and len(spans["training"]) == len(spans["tail"])
    assert any(steps > 1 for _, _, steps in spans["training"])
    for start, end, steps in spans["training"]:
        assert end - start == PER_BLOCK_TRAINING, (steps, log.where())
    for start, end, k in spans["tail"]:
        assert end - start == PER_TAIL, (k, log.where())
    blocks = len(spans["tail"])
    print(f"\n{extra}: {blocks} blocks, {log.n} synchronisations in the round "
          f"({blocks * (PER_BLOCK_TRAINING + PER_TAIL)} in its blocks, 0 per local step); "
          f"the others at {sorted(set(log.where()))}")


def test_local_steps_run_with_synchronisation_as_an_error(tiny_corpus, tmp_path):
    # the strict form: the forward and backward of every local step of a client (batch
    # preparation, the step's copies to the device, the loss) run under sync debug mode
    # "error", which raises at the first synchronisation with its traceback
    world = _world(tiny_corpus, tmp_path, "model.compile=false", "fl.clients_per_step=1")
    runner, engine = world.engine.runner, world.engine
    placement = runner.placement
    client = next(c for c in engine.clients if c.size >= 6)
    items = engine.feeder.load(client)
    runner.train(client.index, items, world.initial_state, 1)  # warm-up
    backward = placement.backward

    def strict(model, batch, params):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return backward(model, batch, params)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    placement.backward = strict
    try:
        update = runner.train(client.index, items, world.initial_state, 1)
    finally:
        del placement.backward
    assert update.steps == 3
