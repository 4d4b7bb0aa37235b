"""Requeueing a preempted task, shared by the one-run task (:class:`~cluster_fl.sweep.grid.GridTask`)
and the packed task (:class:`~cluster_fl.sweep.pack.PackedTask`): both import it, neither imports
the other.

The engine owns SIGUSR2/SIGTERM while it trains, checkpoints at the round boundary and raises
``Preempted``; the task then hands itself back to submitit:

* the job still RUNNING (SIGUSR2 before the time limit, or ``scancel --signal=USR2``): the task
  requeues itself (``scontrol requeue``) as submitit's own handler would;
* the scheduler already stopping it (``scontrol requeue``, preemption, ``scancel``: the job is
  COMPLETING or PENDING when SIGTERM arrives): the task leaves without a result, since a second
  requeue would fail ("Job is pending execution") or bring a cancelled job back.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import submitit
from submitit.helpers import DelayedSubmission

from cluster_fl.errors import PREEMPTED_EXIT
from cluster_fl.sweep.status import slurm_job_state


def requeue(task: Any) -> None:
    """Checkpoint ``task`` (a submitit ``Checkpointable``) into the job's pickle and requeue the
    job (exits the process); when the scheduler is already stopping the job, exit without a
    result instead. Returns only when not inside a requeueable submitit job."""
    from submitit.core.job_environment import SignalHandler

    try:
        env = submitit.JobEnvironment()
    except RuntimeError:
        return
    if env.cluster not in ("slurm", "local"):
        return
    if env.cluster == "slurm":
        state = slurm_job_state(env.job_id)
        if state is not None and state != "RUNNING":
            leave(f"job {env.job_id} is {state}: the scheduler is stopping it (requeue, "
                  "preemption or cancel); not requeueing it again")
    delayed = DelayedSubmission.load(env.paths.submitted_pickle)
    delayed.function = task
    try:
        SignalHandler(env, env.paths, delayed).checkpoint_and_try_requeue(signal.SIGUSR2)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        # raced with the scheduler's own requeue or cancel between the check and the call
        leave(f"scontrol requeue {env.job_id} failed ({exc}); the scheduler decides what runs next")
    # the handler returns only on ranks other than 0, whose rank 0 requeues the whole job
    leave(f"rank {env.global_rank}: checkpointed; rank 0 requeues job {env.job_id}")


def leave(message: str) -> None:
    """End this attempt without a submitit result: the run folder holds the checkpoint and
    ``grid``/``status`` read the run's fate from it once the scheduler is done with the job."""
    print(f"cluster-fl grid: {message}", file=sys.stderr, flush=True)
    raise SystemExit(PREEMPTED_EXIT)
