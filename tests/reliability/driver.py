"""Test driver: ``python driver.py POINT CLI-ARGS...`` runs ``cluster-fl CLI-ARGS`` and stops at
POINT until something from outside (SIGKILL, SIGTERM) ends it.

Points (K = a round number):

* ``setup`` -- the world is built (model, data), no round has run;
* ``round:K`` -- round K has run, its checkpoint is not written yet;
* ``renamed:K`` -- round K's checkpoint has just been renamed into place;
* ``tmpwrite:K`` -- half of round K's checkpoint is in its temporary file, not renamed;
* ``eval`` -- the final evaluation has started (every round checkpointed);
* ``eval-twice`` -- as ``eval``, and when the engine then records ``preempted`` in status.json
  the driver sends itself a second SIGTERM inside that write (the probe's two signals 1 ms apart,
  made deterministic).

At the point it prints ``AT POINT`` on stdout and waits (at most 120 s) while the engine's signal
handler may run: an immediate stop raises out of the wait; a deferred one (a round) lets the
engine carry on to its round boundary. Exits with the CLI's exit code.
"""

from __future__ import annotations

import sys
import threading
import time

from cluster_fl.cli import main
from cluster_fl.engine import checkpoint, evaluation, round as round_mod, setup, train

POINT = sys.argv[1]
KIND, _, ARG = POINT.partition(":")
K = int(ARG) if ARG else None
signalled = threading.Event()


def pause() -> None:
    print(f"AT {POINT}", flush=True)
    deadline = time.monotonic() + 120
    while not signalled.is_set():
        if time.monotonic() > deadline:
            raise SystemExit(f"driver: nobody ended me at {POINT} within 120 s")
        time.sleep(0.02)  # a signal handler that raises does so here


_handler = checkpoint.StopFlag._handler


def handler(self, signum, frame):
    signalled.set()
    _handler(self, signum, frame)


checkpoint.StopFlag._handler = handler

if KIND == "setup":
    _build = setup.build_world

    def build_world(*args, **kwargs):
        world = _build(*args, **kwargs)
        pause()
        return world

    setup.build_world = build_world
elif KIND == "round":
    _run_round = round_mod.RoundEngine.run_round

    def run_round(self, round_, state):
        out = _run_round(self, round_, state)
        if round_ == K:
            pause()
        return out

    round_mod.RoundEngine.run_round = run_round
elif KIND == "renamed":
    _save = train.save_run_checkpoint

    def save_run_checkpoint(folder, state):
        path = _save(folder, state)
        if state["round"] == K:
            pause()
        return path

    train.save_run_checkpoint = save_run_checkpoint
elif KIND == "tmpwrite":
    import os

    _write = checkpoint.atomic_write_bytes
    _save_ckpt = checkpoint.save_run_checkpoint
    current = {}

    def save_run_checkpoint(folder, state):
        current["round"] = state["round"]
        return _save_ckpt(folder, state)

    def atomic_write_bytes(path, data):
        if current.get("round") == K:  # the writer's own temporary name, half written
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(data[:len(data) // 2])
            pause()
        return _write(path, data)

    checkpoint.atomic_write_bytes = atomic_write_bytes
    train.save_run_checkpoint = save_run_checkpoint
elif KIND in ("eval", "eval-twice"):
    _decode = evaluation.ShardedEvaluation.decode

    def decode(self, model, placement):
        pause()
        return _decode(self, model, placement)

    evaluation.ShardedEvaluation.decode = decode
    if KIND == "eval-twice":
        import os
        import signal

        _write_status = train.write_status

        def write_status(folder, state, *args, **kwargs):
            if state == "preempted":  # the second signal lands inside the status write
                os.kill(os.getpid(), signal.SIGTERM)
            return _write_status(folder, state, *args, **kwargs)

        train.write_status = write_status
else:
    raise SystemExit(f"driver: unknown point {POINT}")

raise SystemExit(main(sys.argv[2:]))
