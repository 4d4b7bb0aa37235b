"""launch/repro_lr_sweep.sh on the sweep's committed runs (results/prereg-lr-sweep-v2): the pick per
(regime, method) is the LR with the lowest WER, ties within 0.005 to the smaller LR, and a regime
without runs yet (the sweep runs heavy first) is skipped rather than failing the script."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "results" / "prereg-lr-sweep-v2"  # the superseded corpus-v2 sweep: fixtures
FEDAVG = [f"whisper-tinyllama-tiny__heavy__fedavg__lr-{lr}__s100" for lr in ("0.001", "0.003", "0.01")]


@pytest.mark.skipif(not all((RUNS / r / "final.parquet").exists() for r in FEDAVG),
                    reason="the sweep's heavy FedAvg runs are not in results/")
def test_the_sweep_picks_the_lowest_wer_and_skips_a_regime_without_runs(tmp_path):
    runs = tmp_path / "runs"
    for r in FEDAVG:
        shutil.copytree(RUNS / r, runs / r)
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "launch" / "repro_lr_sweep.sh"), str(runs), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader((out / "picks.csv").open()))
    assert [(r["regime"], r["method"]) for r in rows] == [("heavy", "fedavg")]  # no mild rows
    assert rows[0]["grid_method"] == "fedavg"  # the grid entry's name, as the study grids say it
    (pick,) = rows
    # WER 0.3558 / 0.3352 / 0.3439 at 1e-3 / 3e-3 / 1e-2: 3e-3, more than 0.005 below the others
    assert float(pick["lr"]) == 0.003 and float(pick["wer_mean"]) == pytest.approx(0.3352, abs=5e-5)
    assert pick["candidates"] == "0.001:0.3558 0.003:0.3352 0.01:0.3439"
