"""Helpers of the SLURM tests: ask the cluster, run the CLI as a user would, read run folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

REPO = Path(__file__).resolve().parents[2]
GRID = REPO / "configs" / "grids" / "slurm-ci.yaml"


def cluster_problem() -> str | None:
    """Why no SLURM cluster can run the tests here, or None when one answers."""
    for tool in ("sinfo", "sbatch", "squeue", "sacct", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            return f"no SLURM client ({tool}) on PATH; start one with launch/slurm-local-up.sh"
    try:
        nodes = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
        acct = subprocess.run(["sacct", "-n", "-X", "-S", "now"], capture_output=True, text=True,
                              timeout=15)
    except subprocess.TimeoutExpired:
        return "the SLURM controller or accounting did not answer within 15 s"
    if nodes.returncode != 0:
        return f"no SLURM controller answers: {nodes.stderr.strip()}"
    if not any(s.strip().rstrip("*~#") in ("idle", "mixed", "allocated") for s in nodes.stdout.split()):
        return f"no SLURM node is up (sinfo: {nodes.stdout.split()})"
    if acct.returncode != 0:
        return f"SLURM accounting does not answer (submitit reads states with sacct): {acct.stderr.strip()}"
    return None


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cluster-fl ARGS`` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "cluster_fl", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def cli_background(*args: str, log: Path) -> subprocess.Popen:
    """``cluster-fl ARGS`` left running, stdout and stderr into ``log``."""
    return subprocess.Popen([sys.executable, "-m", "cluster_fl", *map(str, args)], cwd=REPO,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)


def slurm(*args: str) -> str:
    """A SLURM command's stdout (fails the test on a non-zero exit)."""
    out = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(map(str, args))}: {out.stderr}"
    return out.stdout


def accounting(job: str) -> dict[str, str]:
    """``sacct``'s current state of every task of a job: ``{"12_0": "COMPLETED", ...}``."""
    text = slurm("sacct", "-n", "-X", "-P", "-j", job, "-o", "JobID,State")
    return dict(line.split("|", 1) for line in text.splitlines() if "|" in line)


LIVE = ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "CONFIGURING")


def final_accounting(job: str, timeout: float = 120) -> dict[str, str]:
    """``accounting(job)`` once no task of it is live any more: a run's folder says "done" (which is
    what ``grid --wait`` watches) while its task is still exiting, and slurmdbd records the end after
    the task has left squeue."""
    def ended():
        states = accounting(job)
        return states if states and not any(s.split()[0] in LIVE for s in states.values()) else None
    return wait_until(ended, timeout, f"job {job}'s tasks to end in sacct", every=0.5)


def wait_until(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    end = time.time() + timeout
    while time.time() < end:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def status(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def registry(root: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads((root / ".grid" / "jobs.json").read_text())
    except (OSError, ValueError):
        return {}


def write_grid(tmp: Path, experiment: str, methods: tuple[str, ...] = ("flat", "alpha-split"),
               **resources: Any) -> Path:
    """A copy of the CI grid under ``tmp`` with its own experiment name, the given methods and
    resources changed (preset paths made absolute)."""
    raw = yaml.safe_load(GRID.read_text())
    raw["experiment"] = experiment
    for axis in raw["axes"].values():
        for entry in axis:
            entry["preset"] = str((GRID.parent / entry["preset"]).resolve())
    raw["axes"]["method"] = [e for e in raw["axes"]["method"] if e["name"] in methods]
    raw["resources"].update(resources)
    path = tmp / f"{experiment}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path
