"""`slurm/torchrun.sbatch` on a real SLURM: the rendered array job runs one run as 2 ranks (torchrun,
gloo) and its result is bitwise equal to the 1-process run of the same config. On a cluster of two
or more nodes (``.ci/run`` starts two slurmd) the job is 2 tasks on 2 nodes, one torchrun each,
meeting at the first node's rendezvous; on one node it is one torchrun starting both ranks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from cluster_fl.distributed import bitwise_differences
from cluster_fl.engine.checkpoint import load_run_checkpoint
from cluster_fl.engine.metrics import read_rows
from slurm_helpers import REPO, cli, final_accounting, slurm, status, wait_until, write_grid

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

RUN = "whisper-tinyllama-tiny__flat__s0"


def trained(folder) -> dict:
    """Final trainable state and round rows (without wall time) of a finished run folder."""
    ckpt = load_run_checkpoint(folder)
    assert ckpt is not None, f"no checkpoint in {folder}"
    rows = [{k: v for k, v in r.items() if k != "wall_s"} for r in read_rows(folder / "rounds.parquet")]
    return {"state": ckpt["state"], "rows": rows, "round": ckpt["round"]}


def test_torchrun_sbatch_runs_2_ranks_bitwise_equal_to_1_process(tmp_path, tiny_corpus):
    nodes = 2 if len(slurm("sinfo", "-h", "-N", "-o", "%N").split()) >= 2 else 1
    grid = write_grid(tmp_path, "torchrun", methods=("flat",), nodes=nodes,
                      tasks_per_node=2 // nodes, cpus_per_task=1)
    results = tmp_path / "results"
    script = tmp_path / "job.sbatch"
    render = subprocess.run([sys.executable, str(REPO / "slurm" / "render_sbatch.py"), str(grid),
                             "--results", str(results), "--out", str(script),
                             "--set", f"data.corpus={tiny_corpus}", "--set", "fl.rounds=2"],
                            capture_output=True, text=True, cwd=REPO)
    assert render.returncode == 0, render.stderr
    text = script.read_text()
    assert "#SBATCH --array=0-0%1" in text and f"#SBATCH --nodes={nodes}" in text
    assert f"--nproc_per_node={2 // nodes}" in text
    job = re.search(r"(\d+)", slurm("sbatch", "--parsable", script)).group(1)
    wait_until(lambda: not slurm("squeue", "-h", "-r", "-j", job, "-o", "%i").strip(), 300,
               f"job {job} to end", every=1.0)
    log = "\n".join(p.read_text() for p in (results / "torchrun" / ".grid" / "slurm").glob("*.out"))
    assert final_accounting(job) == {f"{job}_0": "COMPLETED"}, log[-4000:]
    if nodes == 2:  # the srun step: 2 tasks on 2 nodes, one torchrun each
        steps = slurm("sacct", "-n", "-P", "-j", f"{job}_0", "-o", "JobID,NNodes,NTasks")
        assert [line.split("|")[1:] for line in steps.splitlines()
                if line.split("|")[0].endswith(".0")] == [["2", "2"]], steps
    folder = results / "torchrun" / RUN
    assert status(folder)["state"] == "done", log[-4000:]
    assert "2 rank(s)" in (folder / "log.txt").read_text()

    # the same config in one process, in another results root
    config = results / "torchrun" / ".grid" / "configs" / f"{RUN}.yaml"
    one = cli("train", config, f"run.out={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    reference = tmp_path / "one" / "torchrun" / RUN
    assert "1 rank(s)" in (reference / "log.txt").read_text()
    torch.set_num_threads(1)
    two, single = trained(folder), trained(reference)
    assert two["round"] == single["round"] == 2
    assert bitwise_differences(two["state"], single["state"]) == []
    assert bitwise_differences(two["rows"], single["rows"]) == []
