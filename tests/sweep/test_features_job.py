"""The features job of a SLURM grid: submitted first, on its own CPU resources, only when a
store is not full, and the training array depends on it (afterok)."""

from __future__ import annotations

from types import SimpleNamespace

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mls_layouts import write_openslr  # noqa: E402

from cluster_fl.config import ConfigError  # noqa: E402
from cluster_fl.sweep import grid as grid_mod  # noqa: E402
from cluster_fl.sweep.features_job import submit_features  # noqa: E402
from cluster_fl.sweep.gridspec import expand, load_grid  # noqa: E402


class FakeJob:
    def __init__(self, job_id: str):
        self.job_id = job_id
        self.paths = SimpleNamespace(stdout=Path(f"{job_id}_0_log.out"),
                                     stderr=Path(f"{job_id}_0_log.err"))


class FakeExecutor:
    """Records what would be submitted; ``run`` calls the tasks here (a task's work)."""

    made: list["FakeExecutor"] = []

    def __init__(self, *args, **kwargs):
        self.params: dict = {}
        self.tasks: list = []
        FakeExecutor.made.append(self)

    def update_parameters(self, **params):
        self.params.update(params)

    def submit_array(self, tasks):
        self.tasks.extend(tasks)
        n = len(FakeExecutor.made)
        return [FakeJob(f"{100 + n}_{i}") for i in range(len(tasks))]


def _grid(tmp_path: Path) -> Path:
    corpus = write_openslr(tmp_path / "corpus", "german",
                           {"train": {"1844": 3, "2223": 2}, "test": {"4004": 2}})
    path = tmp_path / "grid.yaml"
    path.write_text(
        f"experiment: g\nout: {tmp_path / 'out'}\nseeds: [0]\n"
        f"set: {{data.corpus: {corpus}, data.languages: [de], data.client_split: train, "
        f"data.eval_split: test, data.feature_cache: {tmp_path / 'store'}}}\n"
        "axes:\n  method:\n    - {name: a, set: {privacy.clipping: flat}}\n"
        "    - {name: b, set: {privacy.clipping: size}}\n"
        "resources: {gpus_per_task: 1, time_min: 60}\n"
        "features: {tasks: 3, cpus_per_task: 2, mem_gb: 4, time_min: 30, partition: cpu}\n")
    return path


def test_the_features_array_runs_on_its_own_cpus_until_the_store_is_full(tmp_path):
    grid = load_grid(_grid(tmp_path))
    specs = expand(grid)
    FakeExecutor.made = []
    job = submit_features(grid, specs, lambda params: FakeExecutor().update_parameters(
        **params) or FakeExecutor.made[-1])
    (ex,) = FakeExecutor.made
    assert job == "101" and len(ex.tasks) == 3
    assert ex.params["slurm_partition"] == "cpu" and ex.params["cpus_per_task"] == 2
    assert "gpus_per_node" not in ex.params and ex.params["mem_gb"] == 4
    assert [t.part for t in ex.tasks] == [0, 1, 2] and {t.parts for t in ex.tasks} == {3}
    for task in ex.tasks[:2]:
        task()
    assert submit_features(grid, specs, lambda params: FakeExecutor()) is not None  # part 2 left
    ex.tasks[2]()
    assert submit_features(grid, specs, lambda params: FakeExecutor()) is None  # full: no job


def test_a_slurm_grid_makes_its_runs_depend_on_the_features_job(tmp_path, monkeypatch):
    grid = load_grid(_grid(tmp_path))
    FakeExecutor.made = []
    monkeypatch.setattr(grid_mod, "make_executor", lambda g, cluster: FakeExecutor())
    monkeypatch.setattr(grid_mod, "check_resources", lambda g: None)
    monkeypatch.setattr(grid_mod, "check_devices", lambda g, specs, cluster: [])
    monkeypatch.setattr(grid_mod.submitit, "AutoExecutor", FakeExecutor)
    monkeypatch.setattr(grid_mod, "write_registry", lambda g, entries: None)
    grid_mod.submit(grid, expand(grid), "slurm")
    training, features = FakeExecutor.made
    assert len(features.tasks) == 3 and len(training.tasks) == 2
    extra = training.params["slurm_additional_parameters"]
    assert extra == {"requeue": True, "dependency": "afterok:102"}


def test_unknown_features_keys_are_refused(tmp_path):
    path = _grid(tmp_path)
    path.write_text(path.read_text().replace("partition: cpu}", "partition: cpu, gpus: 1}"))
    with pytest.raises(ConfigError, match="features.gpus"):
        load_grid(path)
