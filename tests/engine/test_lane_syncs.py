"""The lane step like the local step: in an FSDP2 lane of two gloo ranks, eager or compiled, a
client's local training reads nothing back from the device per step -- the token total comes
from the transcripts on the host, the loss stays on the device, the gradients and the loss go
in one all-reduce -- counted with tests/host_syncs.py as the local step is in
test_host_syncs.py; and the lane's update equals one unsharded rank's (float32 tolerance)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_helpers import away_from_init, rel_diff, tiny_overrides  # noqa: E402

from cluster_fl.distributed import spawn  # noqa: E402

PER_CLIENT = 1  # the one read of a client's pass over its data (test_host_syncs.py)


def lane_worker(comm: Any, overrides: list[str], perturb: bool = False) -> dict[str, Any]:
    """Build the run's world, train client 1 for 1 and 2 steps under HostReads (from the initial
    state, or with ``perturb`` from one away from init, where every group's gradient is
    nonzero)."""
    import pytest as _pytest

    from host_syncs import HostReads

    from cluster_fl.config import load_config
    from cluster_fl.models.registry import resolve_shapes  # a test stands at the entrance
    from cluster_fl.engine import setup

    torch.set_num_threads(1)
    world = setup.build_world(resolve_shapes(load_config(None, overrides)), comm, lambda m: None)
    runner = world.engine.runner
    client = world.engine.clients[1]
    data = client.load()
    out: dict[str, Any] = {"reads": {}}
    saved = runner.fl
    state = away_from_init(world.initial_state) if perturb else world.initial_state
    for steps in (1, 2):
        runner.fl = dataclasses.replace(saved, max_local_steps=steps)
        runner.train(client.index, data, state, 1)  # warm first-call caches
        with _pytest.MonkeyPatch.context() as m:
            reads = HostReads(m)
            update = runner.train(client.index, data, state, 1)
        out["reads"][update.steps] = (reads.n, reads.report())
        out[f"delta{steps}"] = {k: v.detach().clone() for k, v in update.delta.items()}
    return out


@pytest.fixture(scope="module")
def overrides(tiny_corpus, reference_run, tmp_path_factory):
    return lambda name, *extra: tiny_overrides(
        tiny_corpus, tmp_path_factory.mktemp(name), "fl.batch_size=3", "model.dtype=float32",
        "client.max_grad_norm=1.0", *extra)


def test_a_lane_step_reads_nothing_back_and_equals_the_unsharded_step(overrides):
    one = spawn(lane_worker, 1, overrides("one"), use_fake=True, timeout_s=240)[0]
    lane = spawn(lane_worker, 2, overrides("lane", "model.shard=fsdp2",
                                           "model.shard_group_size=2"), timeout_s=300)
    for member in lane:
        assert sorted(member["reads"]) == [1, 2]
        for steps, (n, report) in member["reads"].items():
            assert n == PER_CLIENT, report  # 0 per step, as the local step
    for steps in (1, 2):
        want = one[f"delta{steps}"]
        for member in lane:
            got = member[f"delta{steps}"]
            assert got.keys() == want.keys()
            # float32, summed in another order: the tolerance of test_lanes.py (REL_TOL)
            assert rel_diff(want, got) <= 1e-5




@pytest.mark.slow  # inductor compiles the layers in both ranks (~1 min on 2 cores, warm cache)
def test_a_compiled_lane_step_reads_nothing_back_and_equals_the_eager_lane(overrides):
    """``model.compile`` in a lane: the layers' forwards are compiled and FSDP2's hooks stay
    eager around them (distributed.parallelize.apply_compile), so a step reads nothing back, and
    the update equals the eager lane's within the compiled step's float32 tolerance
    (test_compiled_step.py's REL_TOL), from a state away from init. A member's share of a batch
    of 3 is 2 rows or 1, so the graphs specialised to one row are in it."""
    lane = ("model.shard=fsdp2", "model.shard_group_size=2")
    eager = spawn(lane_worker, 2, overrides("eager", *lane, "model.compile=false"), True,
                  timeout_s=300)
    # a rank may wait at a gather while the other compiles a graph: gloo waits longer
    compiled = spawn(lane_worker, 2, overrides("compiled", *lane, "model.compile=true"), True,
                     timeout_s=900, comm_timeout_s=600)
    for member in compiled:
        for steps, (n, report) in member["reads"].items():
            assert n == PER_CLIENT, report
    for steps in (1, 2):
        for member in compiled:
            assert rel_diff(eager[0][f"delta{steps}"], member[f"delta{steps}"]) < 1e-4
