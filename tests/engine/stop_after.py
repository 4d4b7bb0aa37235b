"""Test driver: ``python stop_after.py K CLI-ARGS...`` runs ``cluster-fl CLI-ARGS`` and pauses after
round K until a real signal arrives from outside.

After round K's ``run_round`` returns it prints ``PAUSED AFTER ROUND K`` on stdout and waits (at
most 120 s) until the engine's ``StopFlag`` handler has run -- so the test's SIGTERM / SIGUSR2
always lands at the same round boundary, with no timing race. Exits with the CLI's exit code.
"""

from __future__ import annotations

import sys
import threading

from cluster_fl.cli import main
from cluster_fl.engine import checkpoint, round as round_mod

STOP_AFTER = int(sys.argv[1])
signalled = threading.Event()
_handler = checkpoint.StopFlag._handler
_run_round = round_mod.RoundEngine.run_round


def handler(self, signum, frame):  # the engine's own handler, then tell the waiting hook
    _handler(self, signum, frame)
    signalled.set()


def run_round(self, round_, state):
    out = _run_round(self, round_, state)
    if round_ == STOP_AFTER:
        print(f"PAUSED AFTER ROUND {round_}", flush=True)
        if not signalled.wait(120):
            raise SystemExit("stop_after: no signal within 120 s")
    return out


checkpoint.StopFlag._handler = handler
round_mod.RoundEngine.run_round = run_round
raise SystemExit(main(sys.argv[2:]))
