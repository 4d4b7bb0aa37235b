"""How long a federated round of a config takes, before it is queued: ``cluster-fl plan``'s
``--step-seconds``.

A round's wall time is the slowest lane's local steps times the time of one step (the
aggregation -- one all-reduce of the trainable update -- is small beside it)::

    steps per client   min(E x ceil(U / B), fl.max_local_steps)   (the engine's local_steps)
    clients per lane   ceil(fl.clients_per_round / lanes), lanes = GPUs / model.shard_group_size
    lane steps         ceil(clients per lane / fl.clients_per_step) x steps per client
    round              lane steps x step seconds

U is a client's utterances: ``data.max_utterances_per_client`` when set, else ``--utterances``
(default :data:`MLS_LARGEST_SPEAKER`: without a cap the round waits for the largest client).
Every client is counted at U, so the figure is an upper bound: a lane of smaller clients ends
sooner, but the round waits for its slowest lane.
The cohort is the expected one (q·N under Poisson sampling). The step time is the user's:
measured (``bench/gpu_step.py``, or a run's rounds) or stated; the estimate is only as good as
it, and it does not include evaluation or checkpoints.
"""

from __future__ import annotations

import math
from typing import Any

MLS_LARGEST_SPEAKER = 2000  # utterances of MLS's largest training speakers (~2,000)


def round_time(cfg: Any, gpus: int, step_seconds: float | None,
               utterances: int | None = None) -> dict[str, Any]:
    """The estimate of the module docstring as a dict (``seconds`` None without a step time)."""
    fl = cfg.fl
    u = cfg.data.max_utterances_per_client or utterances or MLS_LARGEST_SPEAKER
    lanes = max(1, gpus // max(1, cfg.model.shard_group_size))
    steps = fl.local_epochs * math.ceil(u / fl.batch_size)  # engine.batched.local_steps (a
    if fl.max_local_steps:  # layer above this one; tests/sizing/test_round_time.py compares)
        steps = min(steps, fl.max_local_steps)
    per_lane = math.ceil(fl.clients_per_round / lanes)
    lane_steps = math.ceil(per_lane / fl.clients_per_step) * steps
    return {"utterances_per_client": u, "capped": bool(cfg.data.max_utterances_per_client),
            "steps_per_client": steps, "clients_per_round": fl.clients_per_round,
            "lanes": lanes, "clients_per_lane": per_lane, "lane_steps": lane_steps,
            "step_seconds": step_seconds, "rounds": fl.rounds,
            "seconds": None if step_seconds is None else lane_steps * step_seconds}


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def format_round_time(r: dict[str, Any]) -> str:
    """``≈ N h a round`` and how it was reached, or what to give for it."""
    cap = "data.max_utterances_per_client" if r["capped"] else "no cap: the largest client"
    how = (f"{r['clients_per_round']} clients a round over {r['lanes']} lane(s) "
           f"({r['clients_per_lane']} each) x {r['steps_per_client']} local steps "
           f"({r['utterances_per_client']} utterances, {cap}) = {r['lane_steps']} steps a lane")
    if r["seconds"] is None:
        return f"round: {how}; give --step-seconds S for the time"
    return (f"round: ≈ {_duration(r['seconds'])} a round, ≈ {_duration(r['seconds'] * r['rounds'])}"
            f" for {r['rounds']} rounds ({how} x {r['step_seconds']:g} s)")
