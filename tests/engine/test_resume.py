"""Stop by signal, checkpoint, resume: the resumed run equals the uninterrupted one, bit for bit.

``cluster-fl train`` runs in a subprocess (driven by ``stop_after.py``, which pauses after round 1
until the signal has arrived, so there is no timing race); the test sends a real SIGTERM from
outside. The CLI must checkpoint, mark the run preempted and exit 75; ``run_training`` on the same
folder then finishes it, and the final trainable state and round rows (except wall time) must
equal the single-process reference run of ``conftest.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from engine_helpers import HERE, read_run, tiny_config

from cluster_fl.config import dump_config
from cluster_fl.distributed import bitwise_differences
from cluster_fl.engine.checkpoint import StopFlag
from cluster_fl.errors import PREEMPTED_EXIT
from cluster_fl.engine.train import run_training


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def preempted(tiny_corpus, reference_run, tmp_path_factory):
    """A run stopped by SIGTERM after round 1 through the real CLI."""
    out = tmp_path_factory.mktemp("preempted")
    cfg = tiny_config(tiny_corpus, out)
    config_file = out / "config.yaml"
    config_file.write_text(dump_config(cfg))
    proc = subprocess.Popen([sys.executable, str(HERE / "stop_after.py"), "1", "train",
                             str(config_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    try:
        line = proc.stdout.readline()
        assert line.strip() == "PAUSED AFTER ROUND 1", (line, proc.stderr.read()[-3000:])
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    from cluster_fl.engine.rundir import run_dir

    return {"cfg": cfg, "folder": run_dir(cfg), "rc": proc.returncode, "stderr": stderr}


def test_a_signal_checkpoints_the_round_and_exits_75(preempted):
    assert preempted["rc"] == PREEMPTED_EXIT, preempted["stderr"][-3000:]
    folder = preempted["folder"]
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "preempted" and status["round"] == 1
    run = read_run(folder)
    assert run["round"] == 1 and [r["round"] for r in run["rows"]] == [1]
    assert not (folder / "final.parquet").exists()


def test_the_resumed_run_equals_the_uninterrupted_run_bit_for_bit(preempted, reference_run):
    assert preempted["rc"] == PREEMPTED_EXIT, preempted["stderr"][-3000:]
    torch.set_num_threads(1)
    folder = run_training(preempted["cfg"])
    assert folder == preempted["folder"]
    assert json.loads((folder / "status.json").read_text())["state"] == "done"
    resumed = read_run(folder)
    assert resumed["round"] == reference_run["round"] == 2
    assert bitwise_differences(resumed["state"], reference_run["state"]) == []
    assert bitwise_differences(resumed["rows"], reference_run["rows"]) == []
    # provenance.json: the signalled attempt and the resume, from the same (random-init) start
    record = json.loads((folder / "provenance.json").read_text())
    assert record["starting_model"] == {"checkpoint": None, "model_sha256": None}
    assert len(record["attempts"]) == 2 and all(a["cpu"]["model"] for a in record["attempts"])
    # the adaptive thresholds moved between the rounds: the policy state carried over matters
    thresholds = [{k: v for k, v in r.items() if k.startswith("threshold/")}
                  for r in reference_run["rows"]]
    assert thresholds[0] and thresholds[0] != thresholds[1]
    assert "resumed from round 1" in (folder / "log.txt").read_text()


def test_stop_flag_is_set_by_sigusr2_and_sigterm_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR2)
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        with StopFlag() as stop:
            assert not stop.set
            os.kill(os.getpid(), sig)
            assert stop.set and stop.signum == sig
    assert signal.getsignal(signal.SIGUSR2) is before
