"""``plan``'s round time: steps a lane times the step time, from a grid cell, before queueing.

- the arithmetic of sizing/round_time.py, by hand, with and without the client cap;
- the paper grid bounds a client's work (cap and local-step cap agree) and reads real MLS splits;
- ``cluster-fl plan GRID --cell NAME --step-seconds S`` prints "≈ N h a round".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster_fl.config import load_config
from cluster_fl.sizing.round_time import format_round_time, round_time

ROOT = Path(__file__).resolve().parents[2]


def test_round_time_is_lane_steps_times_the_step_time():
    cfg = load_config(None, ["fl.clients_per_round=94", "fl.local_epochs=10", "fl.batch_size=16",
                             "data.max_utterances_per_client=256"])
    r = round_time(cfg, gpus=4, step_seconds=0.5)
    assert r["steps_per_client"] == 10 * 16 and r["clients_per_lane"] == 24  # ceil(94 / 4)
    assert r["lane_steps"] == 24 * 160 and r["seconds"] == pytest.approx(24 * 160 * 0.5)
    assert format_round_time(r).startswith("round: ≈ 32 min a round")
    uncapped = round_time(load_config(None, ["fl.clients_per_round=94", "fl.local_epochs=10"]),
                          gpus=4, step_seconds=0.5)
    assert uncapped["steps_per_client"] == 10 * 125  # MLS's largest speaker: 2,000 utterances
    assert "no cap" in format_round_time(uncapped) and "4.2 h a round" in \
        format_round_time(uncapped)
    sharded = load_config(None, ["fl.clients_per_round=94", "model.shard_group_size=2",
                                 "model.shard=fsdp2", "fl.max_local_steps=2"])
    r = round_time(sharded, gpus=8, step_seconds=None, utterances=40)
    assert r["lanes"] == 4 and r["lane_steps"] == 24 * 2  # 8 GPUs in lanes of 2; min(3, 2)
    assert "give --step-seconds" in format_round_time(r)
    blocks = load_config(None, ["fl.clients_per_round=94", "fl.clients_per_step=4"])
    r = round_time(blocks, gpus=4, step_seconds=1.0, utterances=40)
    assert r["lane_steps"] == 6 * 3  # ceil(24 / 4) blocks of 4 clients x 3 steps


def test_the_paper_grid_bounds_a_clients_work_on_real_mls_splits():
    from cluster_fl.sweep.gridspec import expand, load_grid

    specs = expand(load_grid(ROOT / "configs" / "grids" / "paper.yaml"))
    for spec in specs:
        d, fl = spec.config.data, spec.config.fl
        assert (d.client_split, d.eval_split, d.max_clients) == ("train", "test", 316)
        assert d.max_utterances_per_client and fl.max_local_steps == \
            fl.local_epochs * -(-d.max_utterances_per_client // fl.batch_size)
        assert spec.config.eval.max_new_tokens == "auto"


def test_plan_prints_the_round_time_of_a_grid_cell(capsys):
    from cluster_fl.cli import main

    grid = str(ROOT / "configs" / "grids" / "paper.yaml")
    assert main(["plan", grid, "--cell", "whisper-tinyllama__unfrozen__alpha-split", "--gpus",
                 "4", "--gpu-memory", "80", "--step-seconds", "0.8"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("round: ≈ 51 min a round") and "40 rounds" in last
    assert main(["plan", grid, "--cell", "nope", "--gpus", "4", "--gpu-memory", "80"]) == 2
    assert "whisper-tinyllama__frozen__fedavg" in capsys.readouterr().err


@pytest.mark.parametrize("u,b,e,cap", [(256, 16, 10, 0), (257, 16, 10, 160), (5, 4, 3, 2),
                                       (2000, 16, 10, 0)])
def test_steps_per_client_are_the_engines(u, b, e, cap):
    from cluster_fl.engine.batched import local_steps

    cfg = load_config(None, [f"fl.batch_size={b}", f"fl.local_epochs={e}",
                             f"fl.max_local_steps={cap}"])
    assert round_time(cfg, 1, None, u)["steps_per_client"] == local_steps(u, b, e, cap)
