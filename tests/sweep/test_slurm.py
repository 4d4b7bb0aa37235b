"""The SLURM path's own logic, without a cluster: the torchrun template, how a run's state is
decided from its folder and its job, how a failure is explained, which requests are refused.

What SLURM itself does (array jobs, requeue, USR2, cancel, sacct, two nodes) is tested against a
real cluster in tests/slurm (``-m slurm``; ``.ci/run`` starts one with launch/slurm-local-up.sh).
"""

import subprocess
from pathlib import Path

import pytest

from cluster_fl.errors import UserError
from cluster_fl.sweep import grid as grid_mod
from cluster_fl.sweep import status
from cluster_fl.sweep.gridspec import load_grid
from cluster_fl.sweep.sbatch import render, write_manifest

REPO = Path(__file__).resolve().parents[2]


def test_torchrun_sbatch_template_renders_array_resources_and_signal(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text((REPO / "configs/grids/paper.yaml").read_text()
                    .replace("../arch/", str(REPO / "configs/arch") + "/")
                    .replace("../method/", str(REPO / "configs/method") + "/"))
    grid = load_grid(path, out=str(tmp_path / "out"))
    todo, _ = grid_mod.pending_runs(grid)
    text = render(grid, write_manifest(grid, todo), len(todo))
    assert f"#SBATCH --array=0-{len(todo) - 1}%16" in text
    for flag in ("--signal=B:USR2@120", "--requeue", "--nodes=1", "--gpus-per-node=4",
                 "--partition=gpu", "--mem=200G", "--time=1440"):
        assert f"#SBATCH {flag}" in text, flag
    assert "--nproc_per_node=4" in text and "--rdzv_backend=c10d" in text
    assert "scontrol requeue" in text and "trap requeue USR2" in text
    assert "cluster_fl.distributed.launch import slurm_port" in text  # the one rule for ports
    manifest = (grid.root / ".grid" / "manifest.txt").read_text().split()
    assert len(manifest) == len(todo) == 117 and all(Path(p).is_file() for p in manifest)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0  # valid shell


@pytest.mark.parametrize("state, alive, expected", [
    ("done", False, "done"), ("done", True, "done"),
    ("running", True, "running"), ("preempted", True, "pending"), (None, True, "pending"),
    ("preempted", False, "failed"), ("running", False, "failed"), ("failed", False, "failed"),
    (None, False, "missing"), (None, None, "missing"),
])
def test_state_comes_from_the_folder_with_the_job_as_supporting_evidence(state, alive, expected):
    folder_status = None if state is None else {"state": state, "round": 1, "rounds": 4,
                                                "updated": "2999-01-01T00:00:00"}
    assert status.decide(folder_status, alive) == expected


def test_a_running_folder_whose_job_cannot_be_asked_is_judged_by_its_heartbeat():
    import datetime as dt

    fresh = {"state": "running", "updated": dt.datetime.now().isoformat()}
    old = {"state": "running", "updated": "2000-01-01T00:00:00"}
    assert status.decide(fresh, None) == "running" and status.decide(old, None) == "failed"


# the ends of a job log as SLURM 22.05 and submitit write them (tests/slurm produces them for real)
REQUEUED = """\
slurmstepd-vm: error: *** STEP 14.0 ON vm CANCELLED AT 2026-12-03T15:35:07 DUE TO JOB REQUEUE ***
slurmstepd-vm: error: *** JOB 14 ON vm CANCELLED AT 2026-12-03T15:35:07 DUE TO JOB REQUEUE ***
srun: Job step aborted: Waiting up to 32 seconds for job step to finish.
"""
CANCELLED = "slurmstepd-vm: error: *** JOB 15 ON vm CANCELLED AT 2026-12-03T15:36:24 ***"


def test_the_reason_from_a_job_log_skips_requeue_notices_and_keeps_a_cancel_or_an_exception():
    assert status.reason_from_log(REQUEUED) is None
    assert status.reason_from_log(REQUEUED + CANCELLED + "\nsrun: error: task 0\n") == CANCELLED
    limit = "slurmstepd: error: *** JOB 16 ON vm CANCELLED AT 2026-12-03T16:00:00 DUE TO TIME LIMIT ***"
    assert status.reason_from_log(REQUEUED + limit) == limit
    trace = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: data.corpus missing\n'
    assert status.reason_from_log(REQUEUED + trace) == "ValueError: data.corpus missing"


def test_sinfo_nodes_of_the_default_or_named_partition_with_gpus(monkeypatch):
    text = "a1|64|512000|gpu:a100:4(S:0-1)|gpu*\na2|64|512000|gpu:a100:4(S:0-1)|gpu*\n" \
           "c1|128|256000|(null)|cpu\n"
    monkeypatch.setattr(status, "_run", lambda cmd: subprocess.CompletedProcess(cmd, 0, text, ""))
    assert status.slurm_nodes() == [{"name": n, "cpus": 64, "mem_mb": 512000, "gpus": 4}
                                    for n in ("a1", "a2")]
    assert status.slurm_nodes("cpu") == [{"name": "c1", "cpus": 128, "mem_mb": 256000, "gpus": 0}]
    assert status.slurm_nodes("nope") == []
    monkeypatch.setattr(status, "_run", lambda cmd: None)  # no sinfo here
    assert status.slurm_nodes() is None


@pytest.mark.parametrize("resources, key", [
    ("cpus_per_task: 33", "resources.cpus_per_task=33"),
    ("{tasks_per_node: 4, cpus_per_task: 9}", "resources.cpus_per_task=9"),
    ("mem_gb: 300", "resources.mem_gb=300"),
    ("gpus_per_task: 1", "resources.gpus_per_task=1"),
    ("nodes: 3", "resources.nodes=3"),
])
def test_a_request_larger_than_any_node_is_refused_naming_the_resource(tmp_path, monkeypatch,
                                                                        resources, key):
    nodes = [{"name": f"n{i}", "cpus": 32, "mem_mb": 256000, "gpus": 0} for i in range(2)]
    monkeypatch.setattr(status, "slurm_nodes", lambda partition=None: nodes)
    path = tmp_path / "grid.yaml"
    text = "experiment: r\nresources:\n  " + (resources if not resources.startswith("{")
                                               else "\n  ".join(resources.strip("{}").split(", ")))
    path.write_text(text + "\n")
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        grid_mod.check_resources(load_grid(path))
    monkeypatch.setattr(status, "slurm_nodes", lambda partition=None: None)  # cannot tell: allow
    grid_mod.check_resources(load_grid(path))
