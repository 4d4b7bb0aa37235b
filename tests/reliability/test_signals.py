"""SIGTERM at any point -- setup, a round, the final evaluation -- ends with exit 75 (``Preempted``),
status ``preempted`` at the last checkpoint, no temporary file, and a rerun identical to the
uninterrupted run.

The default suite sends a real SIGTERM to this very process during setup and during the final
evaluation (the two places that used to die with -15); ``-m slow`` signals the CLI through the
driver at setup, after round 1, during the evaluation and right after a checkpoint rename.
"""

from __future__ import annotations

import os
import signal

import pytest

from reliability_helpers import (ROUNDS, Driven, assert_identical, cli, config_file, folder_of,
                                 status, temp_files, train_in_process)

from cluster_fl.engine import evaluation, setup
from cluster_fl.errors import PREEMPTED_EXIT
from cluster_fl.engine.train import Preempted


def _term_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_setup_and_during_the_final_evaluation_stop_cleanly(
        tiny_corpus, tmp_path, reference, monkeypatch):
    folder = folder_of(tiny_corpus, tmp_path)
    build = setup.build_world

    def build_then_term(*args, **kwargs):
        world = build(*args, **kwargs)
        _term_self()  # the handler raises here: nothing is lost, nothing to save
        return world

    monkeypatch.setattr(setup, "build_world", build_then_term)
    with pytest.raises(Preempted):
        train_in_process(tiny_corpus, tmp_path)
    monkeypatch.setattr(setup, "build_world", build)
    st = status(folder)
    assert (st["state"], st["round"]) == ("preempted", 0)
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler was put back

    decode = evaluation.ShardedEvaluation.decode

    def term_then_decode(self, *args, **kwargs):
        _term_self()
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(evaluation.ShardedEvaluation, "decode", term_then_decode)
    with pytest.raises(Preempted):
        train_in_process(tiny_corpus, tmp_path)
    monkeypatch.setattr(evaluation.ShardedEvaluation, "decode", decode)
    st = status(folder)
    assert (st["state"], st["round"]) == ("preempted", ROUNDS)  # every round checkpointed
    assert not (folder / "final.parquet").exists() and temp_files(folder) == []

    train_in_process(tiny_corpus, tmp_path)  # only the evaluation is left to do
    assert f"resumed from round {ROUNDS}" in (folder / "log.txt").read_text()
    assert_identical(folder, reference)


@pytest.mark.slow
@pytest.mark.parametrize("point,round_", [("setup", 0), ("round:1", 1), ("eval", ROUNDS),
                                          # a signal after round 1 was agreed on stops at the
                                          # next round boundary
                                          ("renamed:1", 2)])
def test_sigterm_through_the_cli_exits_75_and_the_rerun_is_identical(point, round_, tiny_corpus,
                                                                     tmp_path, reference):
    config = config_file(tiny_corpus, tmp_path)
    folder = folder_of(tiny_corpus, tmp_path)
    run = Driven(point, config)
    run.wait_paused()
    run.kill(signal.SIGTERM)
    rc, err = run.finish()
    assert rc == PREEMPTED_EXIT, err[-3000:]
    assert "Traceback" not in err
    st = status(folder)
    assert (st["state"], st["round"]) == ("preempted", round_)
    assert temp_files(folder) == []
    proc = cli("train", str(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_identical(folder, reference)


def test_the_train_command_imports_no_torch_before_its_stop_handlers():
    """engine/provenance.py imported torch at module level, so ``train`` spent its first seconds
    importing torch with no handler installed: a SIGTERM there exited 143 with no status."""
    import subprocess
    import sys

    code = ("import sys, cluster_fl.commands.train; "
            "assert 'torch' not in sys.modules, 'torch imported before the stop handlers'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (``SigCgt`` of /proc/PID/status)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        return False
    return False


@pytest.mark.parametrize("after_s", [0.7, 2.0])
def test_sigterm_in_the_first_seconds_of_train_exits_75_not_143(after_s, tiny_corpus, tmp_path):
    import subprocess
    import sys
    import time

    config = config_file(tiny_corpus, tmp_path)
    env = dict(os.environ, CLUSTER_FL_MALLOC="system")  # no re-exec: one interpreter start
    proc = subprocess.Popen([sys.executable, "-m", "cluster_fl", "train", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        began = time.monotonic()
        # the earliest moment a handler can exist: the CLI's, installed before any heavy import
        # (before it, the kernel's default action is all any program gets). Waiting for it keeps
        # the test from timing the interpreter's own start on a loaded machine.
        while not _catches_sigterm(proc.pid) and time.monotonic() - began < 60:
            time.sleep(0.01)
        time.sleep(max(0.0, after_s - (time.monotonic() - began)))
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == PREEMPTED_EXIT, (proc.returncode, stderr[-2000:])
    assert "Traceback" not in stderr
