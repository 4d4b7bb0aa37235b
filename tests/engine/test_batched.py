"""Batched multi-client training (``fl.clients_per_step`` = K > 1) against one client at a time.

Tolerance: a client trained in a block runs the same operations as alone, on differently shaped
matrices (more rows; features padded to the block's longest utterance), so float32 sums are
accumulated in another order. After a few AdamW steps (whose update is ~lr x sign for small
gradients) the update differs from the one-client update by < 1e-4 relative in L2 (measured
~1e-6 to 1e-5 on the tiny model), which is far below any clip threshold's resolution: clip
decisions, the clipped sum and ε are unchanged. Exact parts are exact: a client's state does not
move after its last step, a non-finite client leaves the others untouched, and a block trains
bitwise the same on any rank (1 vs 2 ranks, resume).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import (cohort_sizes, read_run, rel_diff, tiny_config, tiny_overrides,
                            training_worker)

from cluster_fl.config import dump_config, override
from cluster_fl.distributed import LocalComm, bitwise_differences, spawn
from cluster_fl.engine import cohort as cohort_mod
from cluster_fl.engine.batched import StackedAdamW
from cluster_fl.errors import PREEMPTED_EXIT
from cluster_fl.engine.train import run_training
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)

HERE = Path(__file__).resolve().parent
REL_TOL = 1e-4
K = 3
BATCHED = ("fl.clients_per_step=3",)




@pytest.fixture(scope="module")
def world(tiny_corpus, reference_run, tmp_path_factory):
    from cluster_fl.engine import setup

    torch.set_num_threads(1)
    # float32: the tolerance above is float32's (a bf16 base adds its own rounding to both sides)
    cfg = tiny_config(tiny_corpus, tmp_path_factory.mktemp("batched"), "fl.max_local_steps=3",
                      "fl.batch_size=2", "client.max_grad_norm=1.0", "model.dtype=float32")
    return setup.build_world(cfg, LocalComm(), lambda m: None)


@pytest.fixture(scope="module")
def moved_state(world):
    # a global state away from init (LoRA B is zero at init, so every A gradient would be 0)
    g = torch.Generator().manual_seed(1)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in world.initial_state.items()}


@pytest.fixture(scope="module")
def block(world):
    # four clients, one cut short (fewer batches: it stops stepping before the others)
    items = [(c.index, c.load()) for c in world.engine.clients[:4]]
    items[1] = (items[1][0], items[1][1][:3])
    return items


@pytest.fixture(scope="module")
def sequential(world, block, moved_state):
    return [world.engine.runner.train(i, it, moved_state, 1) for i, it in block]


@pytest.fixture(scope="module", params=[0, 3], ids=["one-pass", "passes-of-3-rows"])
def both(request, world, block, moved_state, sequential):
    # rows_per_pass 3: a step's 7-8 rows run in length-sorted passes of unequal client splits
    runner = world.engine.runner
    runner.rows_per_pass = request.param
    try:
        bat = list(runner.train_cohort(block, moved_state, 1))
    finally:
        runner.rows_per_pass = world.cfg.fl.rows_per_pass
    return sequential, bat


def test_each_client_in_a_block_gets_its_one_client_update(both):
    seq, bat = both
    assert [u.client for u in bat] == [u.client for u in seq]
    assert [u.steps for u in bat] == [u.steps for u in seq]
    assert len(set(u.steps for u in seq)) > 1, "clients should take unequal numbers of steps"
    for a, b in zip(seq, bat):
        assert rel_diff(a.delta, b.delta) < REL_TOL, a.client
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
        assert b.n_samples == a.n_samples


@pytest.mark.parametrize("method", ["flat", "uniform", "size", "uniform-ema", "size-ema",
                                    "quantile", "alpha-split", "pools"])
def test_every_clipping_method_decides_and_clips_the_same(world, both, method):
    # clipping is per client, after training: what matters is that its input (the update) is
    # the same within tolerance; C is set where some clients are clipped and some are not
    from cluster_fl.privacy import make_policy

    seq, bat = both
    extra = {"privacy.clipping": method, "privacy.clip_norm": 0.5}
    if method == "pools":
        extra["privacy.pools"] = [
            {"name": c, "components": [c], "share": s}
            for c, s in (("encoder", 0.2), ("connector", 0.5), ("decoder", 0.3))]
    policy = make_policy(override(world.cfg, extra).privacy, world.groups)
    for a, b in zip(seq, bat):
        ra, rb = policy.clip(a.delta), policy.clip(b.delta)
        assert ra.clipped == rb.clipped, (method, a.client)
        assert rel_diff(ra.update, rb.update) < REL_TOL


def test_a_finished_client_and_a_frozen_group_do_not_move():
    stacks = {"a": torch.randn(3, 4, requires_grad=True), "b": torch.randn(3, 2)}
    before = {k: v.detach().clone() for k, v in stacks.items()}
    opt = StackedAdamW(stacks, {"a": 1.0, "b": 0.0}, weight_decay=0.1)
    for _ in range(3):
        stacks["a"].grad = torch.randn(3, 4)
        opt.step(torch.tensor([1e-2, 1e-2, 1e-2], dtype=torch.float64),
                 torch.tensor([True, False, True]))
    assert torch.equal(stacks["a"][1], before["a"][1])  # inactive: no decay, no moments
    assert torch.equal(opt.m["a"][1], torch.zeros(4))
    assert not torch.equal(stacks["a"][0], before["a"][0])
    assert torch.equal(stacks["b"], before["b"])  # multiplier 0: untouched
    assert opt.t.tolist() == [3.0, 0.0, 3.0]


def test_stacked_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    p = torch.randn(5, 3)
    ref = torch.nn.Parameter(p[1].clone())
    opt_ref = torch.optim.AdamW([ref], lr=3e-3, weight_decay=0.05)
    stacks = {"w": p.clone().requires_grad_(True)}
    opt = StackedAdamW(stacks, {"w": 1.0}, weight_decay=0.05)
    for _ in range(4):
        g = torch.randn(5, 3)
        ref.grad = g[1].clone()
        opt_ref.step()
        stacks["w"].grad = g
        opt.step(torch.full((5,), 3e-3, dtype=torch.float64), torch.ones(5, dtype=torch.bool))
    torch.testing.assert_close(stacks["w"][1].detach(), ref.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows_per_pass", [0, 3])
def test_a_nonfinite_client_does_not_contaminate_its_block(world, block, moved_state,
                                                           sequential, rows_per_pass):
    seq = sequential
    bad = list(block)
    index, items = bad[2]
    poisoned = [dataclasses.replace(x, features=torch.full_like(x.features, float("nan")))
                for x in items]
    bad[2] = (index, poisoned)
    runner = world.engine.runner
    runner.rows_per_pass = rows_per_pass
    try:
        out = list(runner.train_cohort(bad, moved_state, 1))
    finally:
        runner.rows_per_pass = world.cfg.fl.rows_per_pass
    assert not all(torch.isfinite(v).all() for v in out[2].delta.values())
    for j in (0, 1, 3):
        assert all(torch.isfinite(v).all() for v in out[j].delta.values())
        assert rel_diff(seq[j].delta, out[j].delta) < REL_TOL


def test_blocks_are_formed_from_the_cohort_and_sharded_whole():
    sizes = [5, 1, 7, 7, 2, 9, 3]
    blocks = cohort_mod.blocks([0, 2, 3, 4, 5, 6], sizes, 4)
    assert blocks == [[4, 6, 0], [2, 3, 5]]  # by (size, index), two blocks of (at most) four
    assert [len(b) for b in cohort_mod.blocks(list(range(24)), [1] * 24, 16)] == [12, 12]
    assert [len(b) for b in cohort_mod.blocks(list(range(7)), [1] * 7, 3)] == [3, 2, 2]
    lanes = cohort_mod.shard_blocks(blocks, sizes, 2)
    assert sorted(map(tuple, sum(lanes, []))) == sorted(map(tuple, blocks))
    # one client a block: exactly the per-client split
    singles = cohort_mod.blocks([0, 1, 2, 3, 4, 5, 6], sizes, 1)
    assert [[b[0] for b in lane] for lane in cohort_mod.shard_blocks(singles, sizes, 3)] == \
        cohort_mod.shard([0, 1, 2, 3, 4, 5, 6], sizes, 3)


def test_an_empty_client_in_a_block_is_skipped_and_the_rest_train(world, moved_state):
    from cluster_fl.engine.round import ClientData

    engine = world.engine
    saved = engine.clients
    empty = ClientData(index=saved[1].index, client_id="x", speaker="x", language="en",
                       utterances=[])
    runner, trained = engine.runner, []
    original = runner.train_cohort

    def spy(clients, state, round_):
        clients = list(clients)
        trained.append([c for c, _ in clients])
        return original(clients, state, round_)

    try:
        runner.train_cohort = spy
        engine.clients = [saved[0], empty, *saved[2:]]
        engine.cfg = override(world.cfg, {"fl.clients_per_step": 4, "fl.sampling": "fixed",
                                         "fl.clients_per_round": len(saved)})
        facts = engine.run_round(1, moved_state).operator
    finally:
        engine.clients, engine.cfg = saved, world.cfg
        del runner.train_cohort
    assert facts["cohort"] == len(saved) and facts["skipped"] == 1 and facts["trained"] > 0
    # the empty client never reached training; the others trained in blocks of up to 4
    assert trained and all(saved[1].index not in block for block in trained)
    assert sorted(c for block in trained for c in block) == \
        sorted(c.index for c in saved if c.index != saved[1].index)
    assert max(map(len, trained)) > 1


# ---- 1 vs 2 ranks and resume, bit for bit, with K > 1 ------------------------------------------

@pytest.fixture(scope="module")
def batched_one(tiny_corpus, reference_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("batched-one")
    return spawn(training_worker, 1, tiny_overrides(tiny_corpus, out, *BATCHED), use_fake=True,
                 timeout_s=150)[0]


def test_batched_two_ranks_equal_one_process_bit_for_bit(tiny_corpus, batched_one,
                                                         reference_run, tmp_path):
    two = spawn(training_worker, 2, tiny_overrides(tiny_corpus, tmp_path, *BATCHED),
                timeout_s=150)
    assert batched_one["round"] == 2
    assert bitwise_differences(batched_one["state"], two[0]["state"]) == []
    assert bitwise_differences(batched_one["rows"], two[0]["rows"]) == []
    # batching is real here: some round's cohort has a block of more than one client
    cfg = tiny_config(tiny_corpus, tmp_path, *BATCHED)
    from cluster_fl.engine import setup

    world = setup.build_world(cfg, LocalComm(), lambda m: None)
    assert any(len(b) > 1 for r in (1, 2) for b in world.engine.cohort(r)[1])
    # and it trained like one client at a time (same cohort, same noise): states within
    # tolerance, the same privacy spent
    assert rel_diff(reference_run["state"], batched_one["state"]) < 1e-3
    assert cohort_sizes(reference_run["folder"]) == cohort_sizes(batched_one["folder"])
    for a, b in zip(reference_run["rows"], batched_one["rows"]):
        for key in [k for k in a if k.startswith("eps")]:
            assert a[key] == b[key], key


def test_batched_resume_equals_the_uninterrupted_run_bit_for_bit(tiny_corpus, batched_one,
                                                                 tmp_path):
    cfg = tiny_config(tiny_corpus, tmp_path, *BATCHED)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(dump_config(cfg))
    env = dict(__import__("os").environ)  # keeps a PYTHONPATH naming the tree under test
    env["PYTHONPATH"] = __import__("os").pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, str(HERE / "stop_after.py"), "1", "train",
                             str(config_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "PAUSED AFTER ROUND 1", proc.stderr.read()[-3000:]
        proc.send_signal(__import__("signal").SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == PREEMPTED_EXIT, stderr[-3000:]
    torch.set_num_threads(1)
    folder = run_training(cfg)
    assert json.loads((folder / "status.json").read_text())["state"] == "done"
    resumed = read_run(folder)
    assert bitwise_differences(resumed["state"], batched_one["state"]) == []
    assert bitwise_differences(resumed["rows"], batched_one["rows"]) == []


def test_a_zero_lr_multiplier_freezes_a_component_in_a_block_as_alone(world, block, moved_state):
    # client.lr_encoder_mult = 0: the encoder groups get no update in either path (no decay,
    # no moments), the other groups still match the one-client update
    from cluster_fl.engine.client import ClientRunner

    cfg = override(world.cfg, {"client.lr_encoder_mult": 0.0})
    r = world.engine.runner
    runner = ClientRunner(r.model, r.params, r.groups, cfg.fl, cfg.client, r.make_batches, r.seed,
                          r.placement)
    seq = [runner.train(i, it, moved_state, 1) for i, it in block[:3]]
    bat = list(runner.train_cohort(block[:3], moved_state, 1))
    for a, b in zip(seq, bat):
        enc = [k for k in a.delta if k.startswith("encoder.")]
        assert enc and all(torch.count_nonzero(b.delta[k]) == 0 for k in enc)
        assert all(torch.count_nonzero(a.delta[k]) == 0 for k in enc)
        assert rel_diff(a.delta, b.delta) < REL_TOL


def test_batched_clients_with_sharded_lanes_is_a_config_error():
    from cluster_fl.config import ConfigError

    with pytest.raises(ConfigError, match="fl.clients_per_step.*model.shard_group_size: 1"):
        resolved_config(None, ["fl.clients_per_step=4", "model.shard=fsdp2",
                           "model.shard_group_size=2"])
    assert resolved_config(None, ["fl.clients_per_step=4", "model.shard=fsdp2"]).fl.clients_per_step == 4
