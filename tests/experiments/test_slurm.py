"""The SLURM path without SLURM: sbatch text, and preemption -> requeue -> resume with stand-in
SLURM commands on PATH (tests/experiments/fake_slurm.py)."""

import argparse
import os
import subprocess
import time
from pathlib import Path

import pytest

import fake_slurm
from cluster_fl.experiments import grid as grid_mod
from cluster_fl.experiments.gridspec import load_grid
from cluster_fl.experiments.sbatch import render, write_manifest
from fakes import fake_train

REPO = Path(__file__).resolve().parents[2]


def slurm_grid(tmp_path: Path) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(f"""
experiment: s
out: {tmp_path / 'results'}
set: {{fl.rounds: 3, run.device: cpu}}
axes:
  method:
    - {{name: flat, preset: {REPO / 'configs/method/flat.yaml'}}}
    - {{name: size, preset: {REPO / 'configs/method/size.yaml'}}}
seeds: [0]
resources: {{partition: p1, account: acc, time_min: 30, cpus_per_task: 2, mem_gb: 8,
             array_parallelism: 16, signal_delay_s: 120}}
""")
    return path


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    bin_dir, state = fake_slurm.install(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return state


def wait_for(cond, timeout=60.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.2)
    return False


def test_preempted_task_is_requeued_and_resumes_from_its_run_folder(tmp_path, slurm, monkeypatch):
    monkeypatch.setenv("CFL_FAKE_PREEMPT_AT", "1")  # each run sends itself USR2 after round 1
    path = slurm_grid(tmp_path)
    args = argparse.Namespace(grid=str(path), cluster="slurm", dry_run=False, wait=False, out=None,
                              overrides=[])
    assert grid_mod.run(args, train_fn=fake_train) == 0
    # one array job for the whole grid, with the grid's resources and the requeue signal
    scripts = sorted(slurm.glob("sbatch_*.sh"))
    assert len(scripts) == 1
    text = scripts[0].read_text()
    for flag in ("--array=0-1%2", "--signal=USR2@120", "--requeue", "--partition=p1", "--account=acc",
                 "--time=30", "--cpus-per-task=2", "--mem=8GB", "--nodes=1"):
        assert f"#SBATCH {flag}" in text, flag
    # while it runs, a second submission must not submit the queued/running runs again
    assert grid_mod.plan(load_grid(path))[0] == []
    assert wait_for(lambda: set(fake_slurm.task_states(slurm).values()) == {"COMPLETED"}), \
        (slurm / "calls.log").read_text()
    calls = (slurm / "calls.log").read_text()
    assert "scontrol requeue 1000_0" in calls and "scontrol requeue 1000_1" in calls
    root = tmp_path / "results" / "s"
    for run_id in ("flat__s0", "size__s0"):
        # first attempt from round 0, the requeued one resumed after round 1
        assert (root / run_id / "attempts.txt").read_text().split("\n")[:2] == ["start 0", "start 1"]
        assert '"state": "done"' in (root / run_id / "status.json").read_text()
    # finished: resubmitting submits nothing (squeue now says the jobs are gone)
    todo, states = grid_mod.plan(load_grid(path))
    assert todo == [] and {s for _, s in states} == {"done"}


def test_torchrun_sbatch_template_renders_array_resources_and_signal(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text((REPO / "configs/grids/paper.yaml").read_text()
                    .replace("../arch/", str(REPO / "configs/arch") + "/")
                    .replace("../method/", str(REPO / "configs/method") + "/"))
    grid = load_grid(path, out=str(tmp_path / "out"))
    todo, _ = grid_mod.plan(grid)
    text = render(grid, write_manifest(grid, todo), len(todo))
    assert f"#SBATCH --array=0-{len(todo) - 1}%16" in text
    for flag in ("--signal=B:USR2@120", "--requeue", "--nodes=1", "--gpus-per-node=4",
                 "--partition=gpu", "--mem=200G", "--time=1440"):
        assert f"#SBATCH {flag}" in text, flag
    assert "--nproc_per_node=4" in text and "--rdzv_backend=c10d" in text
    assert "scontrol requeue" in text and "trap requeue USR2" in text
    manifest = (grid.root / ".grid" / "manifest.txt").read_text().split()
    assert len(manifest) == len(todo) == 117 and all(Path(p).is_file() for p in manifest)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0  # valid shell
