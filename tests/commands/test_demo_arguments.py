"""``cluster-fl demo`` refuses bad arguments with a clear message before it renders or trains."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("extra, message", [
    (["--ranks", "0"], "--ranks: must be >= 1, got 0"),
    (["--ranks", "-2"], "--ranks: must be >= 1, got -2"),
    (["--methods", "flat,nonsense"], "--methods: unknown nonsense"),
    (["--methods", ","], "--methods: give at least one of"),
])
def test_bad_demo_arguments_are_refused_before_any_work(tmp_path, extra, message):
    proc = subprocess.run([sys.executable, "-m", "cluster_fl", "demo", "--cache", str(tmp_path / "c"),
                           *extra], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "c").exists()  # nothing rendered, nothing trained


def test_the_demo_pretrains_on_a_fixed_thread_count_whatever_the_cores(monkeypatch):
    from cluster_fl.commands import demo
    from cluster_fl.config import load_config

    for cores in (1, 2, 64):
        monkeypatch.setattr("os.cpu_count", lambda: cores)
        assert demo.pretrain_threads(load_config(demo.DEMO_CONFIG, [])) == 2
    assert demo.pretrain_threads(load_config(demo.DEMO_CONFIG, ["run.threads=1"])) == 1
