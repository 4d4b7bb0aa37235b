"""A run killed by a fatal signal inside native code (a compiled kernel, a library) leaves the
Python stack of every thread on stderr, so the job's log names the layer and the op that died.
The 2026-12-05 segfault inside an inductor kernel left a log that ended at the run's header line:
Python prints nothing on SIGSEGV unless faulthandler is on, and no ``except`` runs."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ENGINE_TESTS = Path(__file__).resolve().parent

CRASHING_RUN = """
import faulthandler, sys
sys.path.insert(0, {helpers!r})
import cluster_fl.engine.setup as setup
from cluster_fl.config import load_config
from cluster_fl.engine.train import run_training
from engine_helpers import tiny_overrides

def native_crash(*args, **kwargs):  # stands in for a kernel that reads past a buffer
    faulthandler._sigsegv()

setup.build_world = native_crash
run_training(load_config(None, tiny_overrides({corpus!r}, {out!r})))
"""


def test_a_segfault_in_a_run_prints_the_python_stack(tiny_corpus, tmp_path):
    script = CRASHING_RUN.format(helpers=str(ENGINE_TESTS), corpus=str(tiny_corpus),
                                 out=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    assert "Fatal Python error: Segmentation fault" in proc.stderr
    # the frames down to the native call: where in the run it died
    assert "native_crash" in proc.stderr and "run_training" in proc.stderr


def test_a_stderr_that_is_no_file_leaves_the_run_without_the_dump(monkeypatch):
    """A notebook's stderr has no file descriptor: the run goes on, without the dump."""
    import faulthandler
    import io

    from cluster_fl.engine.train import dump_stacks_on_fatal_signal

    was = faulthandler.is_enabled()
    faulthandler.disable()
    try:
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        assert dump_stacks_on_fatal_signal() is False and not faulthandler.is_enabled()
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        assert dump_stacks_on_fatal_signal() is True and faulthandler.is_enabled()
    finally:
        faulthandler.disable()
        if was:
            faulthandler.enable()
