"""cluster_fl on the peer-benchmark work, through its own API (as bench/engine_bench.py does).

``setup.build_world(cfg, comm, log)`` then ``world.engine.run_round(r, state)``: one process
with the single-process comm, or N ranks over gloo via :func:`cluster_fl.distributed.spawn`.
``fl.clients_per_step`` (K) selects the batched path when K > 1. Client updates are counted
where the round engine consumes them (``runner.train_cohort``), summed over ranks.
"""

from __future__ import annotations

import time
from typing import Any

from bench.peers.common import CellResult, Work, cluster_config, one_thread, round_durations


def _count_updates(world: Any) -> list[int]:
    """Wrap the runner's ``train_cohort`` so every client update it yields is counted."""
    counter = [0]
    runner = world.engine.runner
    inner = runner.train_cohort

    def counting(*args: Any, **kwargs: Any):
        for upd in inner(*args, **kwargs):
            counter[0] += 1
            yield upd

    runner.train_cohort = counting
    return counter


def _rank(comm: Any, cfg_dict: dict, rounds: int) -> dict:
    """One rank: build the world, one warm-up round, then ``rounds`` timed rounds; the round
    boundaries are barriers, so rank 0's clock is the round's wall time."""
    from cluster_fl.config import build_config
    from cluster_fl.engine import setup

    cfg = build_config(cfg_dict)
    setup.set_threads(cfg, comm)
    world = setup.build_world(cfg, comm, lambda m: None)
    counter = _count_updates(world)
    state = world.initial_state
    state = world.engine.run_round(1, state).state  # warm-up: allocator, feature cache
    comm.barrier()
    warm = counter[0]
    stamps, cohorts = [time.perf_counter()], []
    for r in range(2, rounds + 2):
        out = world.engine.run_round(r, state)
        state = out.state
        comm.barrier()
        stamps.append(time.perf_counter())
        cohorts.append(int(out.operator.get("cohort", 0)))  # exact: never in the released row
    return {"updates": counter[0] - warm, "stamps": stamps, "cohorts": cohorts,
            "rank": comm.rank}


def run_cell(work: Work, privacy: str, procs: int, k: int) -> CellResult:
    """Measure cluster_fl with ``procs`` ranks and ``fl.clients_per_step = k``."""
    from cluster_fl.config import to_dict

    one_thread()
    cfg = cluster_config(work, privacy, clients_per_step=k)
    if procs == 1:
        from cluster_fl.distributed import LocalComm

        outs = [_rank(LocalComm(), to_dict(cfg), work.rounds)]
    else:
        from cluster_fl.distributed import spawn

        outs = spawn(_rank, procs, to_dict(cfg), work.rounds, timeout_s=3600, threads=1)
    lead = next(o for o in outs if o["rank"] == 0)
    return CellResult("cluster_fl", privacy, procs, k, sum(o["updates"] for o in outs),
                      round_durations(lead["stamps"]), work.clients,
                      {"n_cohort": lead["cohorts"], "worker_processes": len(outs)})
