"""Host synchronisations of a local step and of a block's tail, counted on the CPU.

Counted with tests/host_syncs.py (every Tensor -> Python conversion, value-dependent op and
``torch.tensor(..., device=)``; on a GPU each is a synchronisation), on the tiny model (eager,
float32). The numbers asserted, exactly:

* **a local step: 0**, one client at a time and K clients at once. Sizes, masks and the decoder's
  layout are prepared on the host from the batch's lengths (host ints, never read back); a
  batch is padded where the client's features live (``PackedExamples.batch``); the batched
  step's row weights, learner index, learning rates and activity flags are made on the host and
  copied from pinned memory without a wait; the loss is accumulated on the device.
* **a client (K = 1) or a block (K > 1): 1** -- its mean loss, read once when it has trained.
* **a block's tail: 1** -- every norm of every client of the block read back in one transfer
  (the clip decisions are taken on the host from them); statistics and diagnostics made on the
  host reach the device in one asynchronous copy; the secure sum's range check runs on the
  device, a failure being raised at the round's reduce (tests/privacy/test_host_reads.py).

Before this (a8c9796), counted the same way: 3 per eager step (the batch's padding length, its
lengths in ``prepare``, the token count) and 2 per pass over a client's data; 5 + K per batched
step (K paddings, the rows' longest length, the lengths, and three ``torch.tensor(...,
device=)`` -- on a GPU blocking copies, like the uncounted ``weight.to(sums)``); 2 per tail
(norms, then the range check), plus on a GPU one blocking copy per host-made statistic. The
host reads among them waited for no device (their tensors were made on the host): they now go
through ``numpy``, which a device tensor cannot take, so they cannot become one unnoticed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import (FAKE_GROUPS, FakeRunner, engine_config, make_engine, random_update,
                            tiny_config)
from host_syncs import HostReads

from cluster_fl.distributed import LocalComm

PER_STEP, PER_CLIENT, PER_TAIL = 0, 1, 1


@pytest.fixture(scope="module")
def world(tiny_corpus, tmp_path_factory):
    from cluster_fl.engine import setup

    torch.set_num_threads(1)
    cfg = tiny_config(tiny_corpus, tmp_path_factory.mktemp("syncs"), "fl.batch_size=2",
                      "client.max_grad_norm=1.0", "model.dtype=float32")
    return setup.build_world(cfg, LocalComm(), lambda m: None)


@pytest.fixture(scope="module")
def clients(world):
    return [(c.index, c.load()) for c in world.engine.clients[:3]]


def _reads(monkeypatch, fn):
    with monkeypatch.context() as m:
        reads = HostReads(m)
        out = fn()
    return reads, out


@pytest.fixture
def steps(world):
    """Set the runner's ``fl.max_local_steps`` for one call."""
    runner = world.engine.runner
    saved = runner.fl

    def set_steps(n: int):
        runner.fl = dataclasses.replace(saved, max_local_steps=n)
        return runner
    yield set_steps
    runner.fl = saved


def test_a_local_step_of_one_client_reads_nothing_back(world, clients, steps, monkeypatch):
    state = world.initial_state
    counts = {}
    for n in (1, 3):
        runner = steps(n)
        runner.train(*clients[1], state, 1)  # warm: first-call caches are not the step's
        reads, upd = _reads(monkeypatch, lambda: runner.train(*clients[1], state, 1))
        counts[upd.steps] = reads.n
        assert reads.n == PER_CLIENT + PER_STEP * upd.steps, reads.report()
    assert sorted(counts) == [1, 3]


def test_a_batched_step_of_k_clients_reads_nothing_back(world, clients, steps, monkeypatch):
    state = world.initial_state
    taken = set()
    for n in (1, 3):
        runner = steps(n)
        reads, upds = _reads(monkeypatch, lambda: list(runner.train_cohort(clients, state, 1)))
        taken.add(max(u.steps for u in upds))
        assert reads.n == PER_CLIENT + PER_STEP * max(u.steps for u in upds), reads.report()
    assert taken == {1, 3}
    runner.rows_per_pass = 2  # several passes a step: still nothing
    try:
        reads, _ = _reads(monkeypatch, lambda: list(runner.train_cohort(clients, state, 1)))
    finally:
        runner.rows_per_pass = world.cfg.fl.rows_per_pass
    assert reads.n == PER_CLIENT, reads.report()


def test_a_blocks_tail_reads_back_once(world, clients, steps, monkeypatch):
    engine, state = world.engine, world.initial_state
    upds = list(steps(2).train_cohort(clients, state, 1))
    engine.summer.reset()
    engine._local = {"trained": 0, "nonfinite": 0, "skipped": 0}
    reads, _ = _reads(monkeypatch, lambda: engine.contribute(1, upds))
    assert reads.n == PER_TAIL, reads.report()
    assert engine.summer.partial()["diag"][0] == len(upds)  # all three were added
    engine.summer.reset()


@pytest.mark.parametrize("extra", [
    ("privacy.clipping=alpha-split", "privacy.inside_pool=ema", "privacy.diagnostics=noised"),
    ("privacy.clipping=quantile", "privacy.diagnostics=exact"),
    ("privacy.mechanism=none",),
], ids=["dp-ema", "dp-quantile-exact", "nonprivate"])
@pytest.mark.parametrize("k", [1, 4])
def test_the_tail_reads_once_whatever_the_policy_and_the_block(extra, k, monkeypatch):
    cfg = engine_config(*extra)
    engine = make_engine(cfg, FakeRunner(random_update), 6)
    upds = [FakeRunner(random_update).train(c, [0] * 3, None, 1) for c in range(k)]
    upds[-1].delta[FAKE_GROUPS[0].name][0, 0] = float("nan")  # a non-finite client among them
    engine._local = {"trained": 0, "nonfinite": 0, "skipped": 0}
    reads, _ = _reads(monkeypatch, lambda: engine.contribute(1, upds))
    assert reads.n == PER_TAIL, reads.report()
    assert engine._local["nonfinite"] == 1
