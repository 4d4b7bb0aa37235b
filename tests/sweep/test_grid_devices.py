"""A grid that would silently train on CPU is refused or warned about before submission, naming
the keys; SLURM's srun gets --cpus-per-task (since 22.05 it does not inherit
sbatch's), in the submitit path and in the torchrun sbatch template."""

from __future__ import annotations

import pytest

from cluster_fl.errors import UserError
from cluster_fl.sweep import grid as grid_mod
from cluster_fl.sweep import status
from cluster_fl.sweep.gridspec import expand, load_grid


def _grid(tmp_path, device: str, gpus: int, partition: str | None = "gpu"):
    text = (f"experiment: d\nout: {tmp_path}\nset:\n  run.device: {device}\n"
            "axes:\n  method:\n    - {name: flat, set: {privacy.clipping: flat}}\n"
            f"resources:\n  gpus_per_task: {gpus}\n  cpus_per_task: 6\n"
            + (f"  partition: {partition}\n" if partition else ""))
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    grid = load_grid(path)
    return grid, expand(grid)


GPU_NODES = [{"name": "g1", "cpus": 64, "mem_mb": 512000, "gpus": 4}]
CPU_NODES = [{"name": "c1", "cpus": 64, "mem_mb": 512000, "gpus": 0}]


@pytest.mark.parametrize("cluster", ["slurm", "local", "debug"])
def test_cuda_cells_without_a_gpu_request_are_refused(tmp_path, cluster):
    grid, specs = _grid(tmp_path, "cuda", 0)
    with pytest.raises(UserError, match=r"run.device=cuda \(cell flat\) with "
                                        r"resources.gpus_per_task=0"):
        grid_mod.check_devices(grid, specs, cluster)
    grid, specs = _grid(tmp_path, "cuda", 1)
    assert grid_mod.check_devices(grid, specs, cluster) == []


def test_auto_without_gpus_on_a_gpu_partition_is_warned_about(tmp_path, monkeypatch):
    grid, specs = _grid(tmp_path, "auto", 0)
    monkeypatch.setattr(status, "slurm_nodes", lambda partition=None: GPU_NODES)
    [line] = grid_mod.check_devices(grid, specs, "slurm")
    assert "run.device=auto" in line and "resources.gpus_per_task=0" in line
    assert "partition gpu" in line and "train on CPU" in line
    monkeypatch.setattr(status, "slurm_nodes", lambda partition=None: CPU_NODES)
    assert grid_mod.check_devices(grid, specs, "slurm") == []
    monkeypatch.setattr(status, "slurm_nodes", lambda partition=None: None)  # cannot tell
    assert grid_mod.check_devices(grid, specs, "slurm") == []
    cpu, cpu_specs = _grid(tmp_path, "cpu", 0)
    monkeypatch.setattr(status, "slurm_nodes", lambda partition=None: GPU_NODES)
    assert grid_mod.check_devices(cpu, cpu_specs, "slurm") == []  # CPU said out loud


def test_the_dry_run_prints_the_warning(tmp_path, monkeypatch, capsys, tiny_corpus):
    import argparse
    import sys
    from pathlib import Path

    from cluster_fl.commands import grid as grid_cmd

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import slurm_fakes  # pre-flight asks sinfo and sbatch --test-only: stand-ins answer

    slurm_fakes.install(tmp_path / "bin", monkeypatch, partitions="gpu", gpus=4)
    _grid(tmp_path, "auto", 0)
    monkeypatch.setattr(status, "slurm_nodes", lambda partition=None: GPU_NODES)
    args = argparse.Namespace(grid=str(tmp_path / "grid.yaml"), cluster="slurm", dry_run=True,
                              wait=False, round0=False, out=None,
                              overrides=[f"data.corpus={tiny_corpus}", "data.languages=[en,de,fr]"])
    assert grid_cmd.run(args) == 0
    assert "warning: run.device=auto" in capsys.readouterr().out


def test_srun_gets_cpus_per_task(tmp_path):
    from cluster_fl.sweep.sbatch import render, write_manifest

    grid, specs = _grid(tmp_path, "cuda", 1)
    params = grid_mod.executor_parameters(grid, "slurm")
    assert params["slurm_srun_args"] == ["--cpus-per-task=6"]
    text = render(grid, write_manifest(grid, specs), len(specs))
    assert "srun --cpus-per-task=6 " in text and "#SBATCH --cpus-per-task=6" in text
