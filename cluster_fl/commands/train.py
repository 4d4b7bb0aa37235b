"""``cluster-fl train CONFIG [key=value ...]``: one experiment, in one process or one rank of many.

The engine (:func:`cluster_fl.engine.train.run_training`) runs or resumes the run and records
how it ended in the run folder; this command turns the ending into an exit code: 0 and the run
folder printed by rank 0 when done, 75 (``PREEMPTED_EXIT``) after a stop signal, 2 for a problem
the user can fix (through the CLI's :class:`~cluster_fl.errors.UserError` handling).
"""

from __future__ import annotations

import argparse

# Light imports only: engine.train defers torch, models and data until the stop handlers are
# installed, so that a SIGTERM during start-up is a clean stop too (exit 75).
from cluster_fl.commands import add_config_arguments, load_checked
from cluster_fl.engine.checkpoint import StopFlag, Stopped
from cluster_fl.errors import PREEMPTED_EXIT
from cluster_fl.engine.train import Preempted, run_training


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        # a signal while reading the config: nothing to save; once the run has stopped or
        # failed, later stop signals are ignored (the exit code and status stand)
        with StopFlag(immediate=True, ignore_after_stop=True):
            cfg = load_checked(args.config, args.overrides)  # shapes from the model
            folder = run_training(cfg)  # records failures in status.json itself
    except (Preempted, Stopped):
        return PREEMPTED_EXIT
    from cluster_fl.distributed.launch import launch_rank

    if launch_rank() == 0:
        print(folder)
    return 0
