"""`cluster-fl grid --cluster slurm` against a real SLURM (slurmctld, slurmd, slurmdbd): one array
job, resubmission, preemption by the scheduler (``scontrol requeue``) and by the time-limit signal
(USR2), a cancelled task, and requests no node can satisfy. Each run is the tiny random-init model
on the session's tiny corpus (configs/grids/slurm-ci.yaml)."""

from __future__ import annotations

import contextlib
import json
import re

import pyarrow.parquet as pq
import pytest

from slurm_helpers import (GRID, cli, cli_background, final_accounting, registry, slurm, status,
                           wait_until, write_grid)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

FLAT = "whisper-tinyllama-tiny__flat__s0"
SPLIT = "whisper-tinyllama-tiny__alpha-split__s0"


def job_of(stdout: str) -> str:
    m = re.search(r"submitted \d+ runs to slurm \(job (\d+)\)", stdout)
    assert m, stdout
    return m.group(1)


def failures(text: str) -> list[str]:
    return re.findall(r"^run \S+ failed: .*$", text, re.M)


@contextlib.contextmanager
def waiting_grid(out, log, corpus, rounds: int):
    """``grid --wait`` on the slurm-ci grid in the background (output to ``log``), once both
    runs are in the job registry: yields (the process, the registry); killed on leaving."""
    grid = cli_background("grid", GRID, "--cluster", "slurm", "--wait", "--out", out,
                          "--set", f"data.corpus={corpus}", "--set", f"fl.rounds={rounds}",
                          log=log)
    root = out / "slurm-ci"
    try:
        yield grid, wait_until(lambda: registry(root) if len(registry(root)) == 2 else None, 60,
                               "the job registry")
    finally:
        if grid.poll() is None:
            grid.kill()
            grid.wait()


def rounds_of(folder) -> list[int]:
    return [int(r) for r in pq.read_table(folder / "rounds.parquet").column("round").to_pylist()]


def test_grid_is_one_array_job_that_finishes_and_resubmission_submits_nothing(tmp_path, tiny_corpus):
    out = tmp_path / "results"
    args = ("grid", GRID, "--cluster", "slurm", "--out", out, "--set", f"data.corpus={tiny_corpus}",
            "--set", "fl.rounds=2")
    first = cli(*args, "--wait", timeout=400)
    assert first.returncode == 0, first.stdout + first.stderr
    assert not failures(first.stdout), first.stdout
    job = job_of(first.stdout)
    assert final_accounting(job) == {f"{job}_0": "COMPLETED", f"{job}_1": "COMPLETED"}  # one array job
    # the runs' array (the features job, submitted first, has its own script beside it)
    script = (out / "slurm-ci" / ".grid" / "logs" / f"{job}_submission.sh").read_text()
    for flag in ("--array=0-1%2", "--cpus-per-task=1", "--mem=3GB", "--time=15", "--signal=USR2@60",
                 "--requeue"):
        assert f"#SBATCH {flag}" in script, flag

    states = [json.loads(line) for line in cli("status", GRID, "--out", out, "--json").stdout.splitlines()]
    assert {s["run_id"]: s["state"] for s in states} == {FLAT: "done", SPLIT: "done"}
    again = cli(*args, "--wait")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().splitlines()[-1] == "submitted 0 runs to slurm"
    table = cli("table", out / "slurm-ci", "--format", "csv", "--bootstrap", "20")
    assert table.returncode == 0 and len(table.stdout.strip().splitlines()) == 1 + 2, table.stdout


def test_runs_preempted_by_scontrol_requeue_and_by_usr2_resume_and_the_grid_reports_success(
        tmp_path, tiny_corpus):
    out, rounds = tmp_path / "results", 8
    root, log = out / "slurm-ci", tmp_path / "grid.log"
    with waiting_grid(out, log, tiny_corpus, rounds) as (grid, jobs):
        job = {run: record["job_id"] for run, record in jobs.items()}
        # mid-run: after the first round, before the last
        wait_until(lambda: status(root / FLAT).get("round", 0) >= 1, 240, f"round 1 of {FLAT}")
        slurm("scontrol", "requeue", job[FLAT])  # the scheduler preempts and requeues
        wait_until(lambda: status(root / SPLIT).get("round", 0) >= 1, 240, f"round 1 of {SPLIT}")
        slurm("scancel", "--signal=USR2", job[SPLIT])  # what --signal=USR2@60 sends before the limit
        # while the requeued run waits for its second start, status must not call it failed
        wait_until(lambda: status(root / FLAT).get("state") == "preempted", 60, f"{FLAT} preempted")
        now = {json.loads(line)["run_id"]: json.loads(line)["state"]
               for line in cli("status", GRID, "--out", out, "--json").stdout.splitlines()}
        assert now[FLAT] in ("pending", "running", "done"), now
        rc = grid.wait(timeout=400)
    text = log.read_text()
    assert rc == 0, text
    assert not failures(text), text
    for run in (FLAT, SPLIT):
        folder = root / run
        assert status(folder)["state"] == "done"
        assert rounds_of(folder) == list(range(1, rounds + 1))  # each round exactly once
        assert pq.read_table(folder / "final.parquet").num_rows == 1
        stopped = re.findall(r"stopped by signal after round (\d+)", (folder / "log.txt").read_text())
        resumed = re.findall(r"resumed from round (\d+)", (folder / "log.txt").read_text())
        assert len(stopped) == 1 and resumed == stopped and 1 <= int(stopped[0]) < rounds, run
        # the first attempt ended without an error result (the old bug: CalledProcessError)
        err = (root / ".grid" / "logs" / f"{job[run]}_0_log.err").read_text()
        assert "CalledProcessError" not in err and "Traceback" not in err, err[-3000:]
    assert set(final_accounting(job[FLAT].split("_")[0]).values()) == {"COMPLETED"}


def test_a_cancelled_task_is_reported_failed_with_the_reason_from_its_log(tmp_path, tiny_corpus):
    out, rounds = tmp_path / "results", 8
    root, log = out / "slurm-ci", tmp_path / "grid.log"
    with waiting_grid(out, log, tiny_corpus, rounds) as (grid, jobs):
        cancelled = jobs[SPLIT]["job_id"]
        wait_until(lambda: status(root / SPLIT).get("round", 0) >= 1, 240, f"round 1 of {SPLIT}")
        slurm("scancel", cancelled)
        rc = grid.wait(timeout=400)
    text = log.read_text()
    assert rc == 1, text
    line = next(line for line in text.splitlines() if line.startswith(f"run {SPLIT} failed: "))
    assert f"job {cancelled} CANCELLED" in line, line
    assert re.search(r"\*\*\* (JOB|STEP) \S+ ON \S+ CANCELLED AT", line), line
    assert f"run {FLAT} failed" not in text and status(root / FLAT)["state"] == "done"
    # the task was not brought back by a requeue of its own
    assert final_accounting(cancelled.split("_")[0])[cancelled].startswith("CANCELLED")
    assert cancelled not in slurm("squeue", "-h", "-r", "-o", "%i")
    report = cli("status", GRID, "--out", out)
    assert f"failed {SPLIT}: job {cancelled} CANCELLED" in report.stdout, report.stdout
    dry = cli("grid", GRID, "--cluster", "slurm", "--out", out, "--set", f"data.corpus={tiny_corpus}",
              "--dry-run")  # pre-flight checks the corpus: the one the runs used
    assert f"would submit {SPLIT}" in dry.stdout and dry.stdout.count("would submit") == 1, dry.stdout


@pytest.mark.parametrize("key, value", [("cpus_per_task", 512), ("mem_gb", 100_000), ("nodes", 64)])
def test_a_request_no_node_can_satisfy_is_refused_before_submission(tmp_path, tiny_corpus, key, value):
    experiment = f"impossible-{key.replace('_', '-')}"
    path = write_grid(tmp_path, experiment, **{key: value})
    run = cli("grid", path, "--cluster", "slurm", "--out", tmp_path / "results",
              "--set", f"data.corpus={tiny_corpus}")
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"resources.{key}={value}" in run.stderr and "no node can ever run it" in run.stderr, run.stderr
    assert not (tmp_path / "results" / experiment / ".grid" / "jobs.json").exists()
    assert f"cfl-{experiment}" not in slurm("sacct", "-n", "-X", "-P", "-S", "now-1hours", "-o", "JobName")
