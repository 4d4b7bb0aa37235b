"""Many runs per GPU: ``resources.runs_per_gpu`` N packs N runs on each GPU of
a task (on CPU: N runs sharing the task's CPUs), each its own ``cluster-fl train`` process with
its own CPUs and no launcher variables, after ``plan`` has checked that N runs fit the memory.
Tested here on CPU as N runs per node through the local cluster."""

from __future__ import annotations

import argparse
import json

import pytest

from cluster_fl.config import ConfigError
from cluster_fl.distributed.launch import single_process_env, split_cpus, task_gpus
from cluster_fl.errors import UserError
from cluster_fl.sweep.gridspec import expand, load_grid
from cluster_fl.sweep.pack import GridPack, check_packing, packs, runs_per_task

GRID = """experiment: packed
out: {out}
set:
  data.corpus: {corpus}
  data.languages: [en, de, fr]
  fl.rounds: 1
  fl.clients_per_round: 3
  fl.sampling: fixed
  fl.max_local_steps: 1
  fl.batch_size: 2
  eval.max_utterances: 2
  eval.bootstrap: 10
  eval.max_new_tokens: 4
  run.device: cpu
axes:
  method:
    - {{name: flat, set: {{privacy.clipping: flat}}}}
    - {{name: size, set: {{privacy.clipping: size}}}}
seeds: [0]
resources:
  {resources}
"""


def _grid(tmp_path, resources: str, corpus="/nowhere"):
    path = tmp_path / "grid.yaml"
    path.write_text(GRID.format(out=tmp_path / "results", corpus=corpus, resources=resources))
    return path


def test_runs_are_dealt_into_tasks_n_a_gpu(tmp_path):
    grid = load_grid(_grid(tmp_path, "{runs_per_gpu: 2, gpus_per_task: 2, gpu_memory_gb: 80}"))
    assert runs_per_task(grid) == 4
    specs = expand(grid) * 3  # six runs
    assert [len(p) for p in packs(grid, specs)] == [4, 2]
    pack = GridPack([], 2, 2, str(tmp_path))
    assert [s["gpu"] for s in pack.slots(4)] == ["0", "0", "1", "1"]


def test_each_run_sees_its_gpu_and_its_cpus_and_no_launcher_variables(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert task_gpus(2) == ["3", "5"] and task_gpus(1) == ["3"]
    env = single_process_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "23456",
                              "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7",
                              "PATH": "/bin"}, gpu="5")
    assert env == {"SLURM_JOB_ID": "7", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "5"}
    parts = split_cpus(set(range(7)), 3)
    assert [len(p) for p in parts] == [3, 2, 2] and set().union(*parts) == set(range(7))
    assert all(not (a & b) for i, a in enumerate(parts) for b in parts[i + 1:])
    assert split_cpus({4}, 2) == [{4}, {4}]


def test_a_pack_needs_one_process_a_run():
    from cluster_fl.sweep.gridspec import Resources

    with pytest.raises(ConfigError, match="resources.runs_per_gpu"):
        Resources(runs_per_gpu=2, tasks_per_node=2)
    with pytest.raises(ConfigError, match="resources.gpu_memory_gb"):
        Resources(gpu_memory_gb=0)


def test_plan_checks_that_the_packed_runs_fit_before_submission(tmp_path):
    specs_of = lambda text: (lambda g: (g, expand(g)))(load_grid(_grid(tmp_path, text)))  # noqa: E731
    grid, specs = specs_of("{runs_per_gpu: 4, gpus_per_task: 1}")
    with pytest.raises(UserError, match="needs resources.gpu_memory_gb"):
        check_packing(grid, specs)
    grid, specs = specs_of("{runs_per_gpu: 4, gpus_per_task: 1, gpu_memory_gb: 2}")
    with pytest.raises(UserError, match=r"resources.runs_per_gpu=4: cell flat: [\d.]+ GiB a run "
                                        r"x runs_per_gpu 4 = [\d.]+ GiB of 2 GiB "
                                        r"\(resources.gpu_memory_gb=2\)"):
        check_packing(grid, specs)
    grid, specs = specs_of("{runs_per_gpu: 4, gpus_per_task: 1, gpu_memory_gb: 141}")
    [line] = check_packing(grid, specs)  # both cells have one model: planned once
    assert "x runs_per_gpu 4" in line and "of 141 GiB" in line
    grid, specs = specs_of("{runs_per_gpu: 2, mem_gb: 0.1}")  # CPU: the task's memory
    with pytest.raises(UserError, match=r"resources.mem_gb=0.1"):
        check_packing(grid, specs)


@pytest.mark.slow  # a grid through the local cluster (~16 s): .ci/run's slow stage runs it
def test_two_runs_share_one_local_task_side_by_side(tiny_corpus, tmp_path):
    from cluster_fl.commands import grid as grid_cmd
    from cluster_fl.sweep.status import read_registry, read_status

    path = _grid(tmp_path, "{runs_per_gpu: 2, cpus_per_task: 2, mem_gb: 8, time_min: 15, "
                           "array_parallelism: 1}", corpus=tiny_corpus)
    args = argparse.Namespace(grid=str(path), cluster="local", dry_run=False, wait=True,
                              round0=False, out=None, overrides=[])
    assert grid_cmd.run(args) == 0
    grid = load_grid(path)
    specs = expand(grid)
    registry = read_registry(grid)
    assert len({registry[s.run_id]["job_id"] for s in specs}) == 1  # one task, two runs
    for spec in specs:
        from cluster_fl.sweep.gridspec import run_folder

        assert (read_status(run_folder(spec.config)) or {}).get("state") == "done"
    import time

    deadline = time.monotonic() + 60  # --wait returns when the runs are done; the task, after
    while not list((grid.root / ".grid" / "packs").glob("pack-*.json")):
        assert time.monotonic() < deadline, "the pack wrote no record"
        time.sleep(0.2)
    [record_file] = (grid.root / ".grid" / "packs").glob("pack-*.json")
    record = json.loads(record_file.read_text())
    assert sorted(r["run_id"] for r in record) == sorted(s.run_id for s in specs)
    assert all(r["exit"] == 0 and r["gpu"] is None for r in record)
    cpus = [set(r["cpus"]) for r in record]
    from cluster_fl.distributed.launch import cpu_mask

    if len(cpu_mask()) >= 2:  # each run pinned to CPUs of its own
        assert not (cpus[0] & cpus[1])
