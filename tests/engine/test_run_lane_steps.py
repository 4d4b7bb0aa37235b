"""A run's expected lane steps (``engine.setup.run_lane_steps``): what ``model.compile: auto``
weighs against the compile's cost on a CPU without fast bf16."""

from __future__ import annotations

import math

from cluster_fl.config import load_config
from cluster_fl.engine.setup import run_lane_steps


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_rounds_times_a_lanes_blocks_times_a_clients_mean_steps():
    cfg = _cfg("fl.rounds=10", "fl.clients_per_round=8", "fl.batch_size=4", "fl.local_epochs=2")
    sizes = [4, 8, 12, 16]  # 1, 2, 3, 4 batches; 2 epochs: 2, 4, 6, 8 steps, mean 5
    # the cohort is capped by the population (4 clients), over 2 lanes: 2 clients a lane
    assert run_lane_steps(cfg, sizes, lanes=2) == 10 * 2 * 5
    assert run_lane_steps(cfg, sizes, lanes=1) == 10 * 4 * 5


def test_a_step_cap_blocks_of_clients_and_no_clients():
    cfg = _cfg("fl.rounds=3", "fl.clients_per_round=6", "fl.batch_size=2",
               "fl.max_local_steps=2", "fl.clients_per_step=4")
    sizes = [10] * 20  # 5 batches a client, capped at 2 steps
    # 6 clients on one lane, 4 a step: 2 blocks of 2 steps a round
    assert run_lane_steps(cfg, sizes, lanes=1) == 3 * math.ceil(6 / 4) * 2
    assert run_lane_steps(cfg, [], lanes=1) == 0
