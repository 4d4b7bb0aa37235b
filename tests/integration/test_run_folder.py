"""Whole runs through ``run_training`` and the ``cluster-fl train`` CLI: guarantees, reruns, errors.

- a non-private run (``privacy.mechanism=none``) records the guarantee ``none`` and method ``none``;
- ``privacy.diagnostics=exact`` and the paper's non-private EMA statistic
  (``privacy.adaptive_private=false``) record the guarantee ``void`` with a reason;
- a finished run is never rewritten: a second ``run_training`` returns the same folder and leaves
  every file (and its modification time) as it was;
- a bad config through ``cluster-fl train`` exits 2 with exactly one line on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from cluster_fl.config import load_config
from cluster_fl.engine.train import run_training

TINY = ["model.arch=whisper-tinyllama-tiny", "fl.clients_per_round=4", "fl.max_local_steps=2",
        "fl.batch_size=4", "eval.max_utterances=4", "eval.bootstrap=10", "eval.max_new_tokens=6",
        "run.threads=1"]


def _run(corpus: Path, out: Path, *extra: str) -> Path:
    torch.set_num_threads(1)
    cfg = load_config(None, [f"data.corpus={corpus}", "data.languages=[en,de,fr]",
                             f"run.out={out}", *TINY, *extra])
    return run_training(cfg)


@pytest.fixture(scope="module")
def nonprivate_run(tiny_corpus, tmp_path_factory) -> Path:
    return _run(tiny_corpus, tmp_path_factory.mktemp("nonprivate"), "privacy.mechanism=none",
                "fl.rounds=2")


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_non_private_run_records_guarantee_none(nonprivate_run):
    privacy = json.loads((nonprivate_run / "privacy.json").read_text())
    assert privacy["guarantee"] == "none"
    final = pq.read_table(nonprivate_run / "final.parquet").to_pylist()[0]
    assert final["method"] == "none" and final["guarantee"] == "none"
    assert final["noise_multiplier"] == 0.0
    status = json.loads((nonprivate_run / "status.json").read_text())
    assert status["state"] == "done" and status["round"] == 2
    rows = pq.read_table(nonprivate_run / "rounds.parquet").to_pylist()
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["n_clients"] >= 1 and r["n_nonfinite"] == 0 for r in rows)


def test_a_finished_run_is_not_rewritten(nonprivate_run, tiny_corpus):
    before = _snapshot(nonprivate_run)
    assert {"config.yaml", "status.json", "rounds.parquet", "final.parquet", "eval.parquet",
            "privacy.json", "groups.json", "checkpoint/state.pt"} <= set(before)
    again = _run(tiny_corpus, nonprivate_run.parents[1], "privacy.mechanism=none", "fl.rounds=2")
    assert again == nonprivate_run
    assert _snapshot(nonprivate_run) == before


@pytest.mark.parametrize("extra,reason", [
    (("privacy.diagnostics=exact",), "diagnostics"),
    (("privacy.clipping=size-ema", "privacy.adaptive_private=false"), "adaptive"),
    (("audit.record_channels=true",), "record_channels"),
])
def test_exact_diagnostics_or_a_non_private_statistic_record_guarantee_void(tiny_corpus, tmp_path,
                                                                            extra, reason):
    folder = _run(tiny_corpus, tmp_path, *extra, "fl.rounds=1")
    privacy = json.loads((folder / "privacy.json").read_text())
    assert privacy["guarantee"] == "void"
    assert any(reason in r for r in privacy["void_reasons"]), privacy["void_reasons"]
    final = pq.read_table(folder / "final.parquet").to_pylist()[0]
    assert final["guarantee"] == "void"


@pytest.mark.parametrize("override", ["privacy.alpha=2", "privacy.no_such_key=1",
                                      "fl.sampling=sometimes"])
def test_a_bad_config_through_the_cli_exits_2_with_one_stderr_line(override, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("fl:\n  rounds: 1\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "cluster_fl", "train", str(config), override,
                           f"run.out={tmp_path / 'out'}"], capture_output=True, text=True,
                          env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert override.split("=")[0] in lines[0]
    assert not (tmp_path / "out").exists()
