"""Where each run of a grid stands, and the ``cluster-fl status GRID`` command.

A run's state comes from its run folder first and from the scheduler second. The folder's
``status.json`` (written by the engine: running / preempted / failed / done) is the record of the
work; the grid's job registry ``<out>/<experiment>/.grid/jobs.json`` (written by ``grid`` at
submission: which scheduler job runs which run id) says whom to ask whether the run's job is still
alive. The scheduler is only supporting evidence: a job that SLURM stopped and requeued (its first
attempt may end with an error) is judged by what the folder says once the requeued attempt ends,
so a run that finished is never reported failed. The decision ``grid`` makes:

=========  ===================================================================  ==========
state      meaning                                                              resubmit?
=========  ===================================================================  ==========
done       status.json says done (whatever the scheduler says)                  no
running    status.json says running and its job is alive (or, with no job        no
           record, its heartbeat is younger than ``stale_s``)
pending    its job is alive, and the folder has no status yet or says            no
           preempted (queued, requeued, starting)
failed     status.json says failed, preempted or running, and its job is over   yes
missing    no run folder status and no live job                                 yes
=========  ===================================================================  ==========

:func:`failure_reason` explains a failed run: the folder's recorded error, else the scheduler's
final state (``sacct``) and the telling line of the job's log (SLURM's ``*** JOB … CANCELLED …``,
the exception of a traceback).

:func:`run_progress` says how far a run is: round r/R and ε so far from its folder, the WER of a
done run from ``final.parquet``, and the ETA of a running one from the round times of its
operator log (``.operator/``, beside the run folders: the operator's own file, read for the
operator's screen and never copied into anything released).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import socket
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

from cluster_fl.engine.rundir import read_status
from cluster_fl.sweep.gridspec import Grid, RunSpec, expand, run_folder

STATES = ("done", "running", "pending", "failed", "missing")
RESUBMIT = ("failed", "missing")
STALE_S = 3600.0
# states of a SLURM job that is over (squeue -j may still list one until MinJobAge passes)
SLURM_FINAL = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}


def registry_path(grid: Grid) -> Path:
    """The grid's job registry: run id -> {cluster, job_id, host, submitted}."""
    return grid.root / ".grid" / "jobs.json"


def read_registry(grid: Grid) -> dict[str, dict[str, Any]]:
    """The job registry (empty when nothing was submitted yet)."""
    path = registry_path(grid)
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def write_registry(grid: Grid, records: Mapping[str, Mapping[str, Any]]) -> None:
    """Merge ``records`` into the registry, atomically (tmp file + rename)."""
    path = registry_path(grid)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**read_registry(grid), **records}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _run(cmd: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def slurm_live_jobs(job_ids: Sequence[str]) -> dict[str, str] | None:
    """``squeue``'s state of each of ``job_ids`` (``JOB`` or ``JOB_TASK``) that SLURM still holds,
    in one call; ids it no longer holds are absent. None when squeue cannot answer."""
    if not job_ids:
        return {}
    out = _run(["squeue", "-h", "-r", "-j", ",".join(sorted(set(job_ids))), "-o", "%i|%T"])
    if out is None:
        return None
    if out.returncode != 0:  # every id finished and forgotten: "Invalid job id specified"
        return {} if "nvalid job id" in out.stderr else None
    states = dict(line.strip().split("|", 1) for line in out.stdout.splitlines() if "|" in line)
    return {j: states[j] for j in job_ids if states.get(j, "COMPLETED") not in SLURM_FINAL}


def slurm_job_state(job_id: str) -> str | None:
    """The controller's ``JobState`` of one job (RUNNING, COMPLETING, PENDING, ...), None when it
    cannot be told. A task stopped by the scheduler itself (``scontrol requeue``, preemption,
    ``scancel``, the time limit) is already COMPLETING or PENDING when its signal arrives."""
    out = _run(["scontrol", "show", "job", "-o", str(job_id)])
    if out is None or out.returncode != 0:
        return None
    m = re.search(r"\bJobState=(\S+)", out.stdout)
    return m.group(1) if m else None


def slurm_final_state(job_id: str) -> str | None:
    """``sacct``'s state of a finished job (``CANCELLED by 0``, ``TIMEOUT``, ``FAILED``, ...)."""
    out = _run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State"])
    if out is None or out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        jid, _, state = line.partition("|")
        if jid.strip() == str(job_id) and state.strip():
            return state.strip()
    return None


def slurm_nodes(partition: str | None = None) -> list[dict[str, Any]] | None:
    """Nodes of ``partition`` (default: SLURM's default partition) with their CPUs, memory (MB)
    and GPU count, from ``sinfo``; None when sinfo cannot answer."""
    out = _run(["sinfo", "-h", "-N", "-o", "%N|%c|%m|%G|%P"])
    if out is None or out.returncode != 0:
        return None
    nodes = []
    for line in out.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, cpus, mem, gres, part = fields
        default = part.endswith("*")
        if (part.rstrip("*") != partition) if partition else not default:
            continue
        gpus = sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", gres))
        nodes.append({"name": name, "cpus": int(cpus.rstrip("+")), "mem_mb": int(mem.rstrip("+")),
                      "gpus": gpus})
    return nodes


def jobs_alive(records: Mapping[str, Mapping[str, Any] | None]) -> dict[str, bool | None]:
    """``run id -> alive?`` for registry records (one ``squeue`` call for all SLURM jobs)."""
    alive: dict[str, bool | None] = {}
    slurm = {run: str(r["job_id"]) for run, r in records.items() if r and r.get("cluster") == "slurm"}
    live = slurm_live_jobs(list(slurm.values())) if slurm else {}
    for run, record in records.items():
        if not record:
            alive[run] = None
        elif run in slurm:
            alive[run] = None if live is None else slurm[run] in live
        elif record.get("cluster") == "local":
            alive[run] = _local_alive(record)
        else:
            alive[run] = False  # debug jobs run in-process and are over when `grid` returns
    return alive


def _local_alive(record: Mapping[str, Any]) -> bool | None:
    if record.get("host") != socket.gethostname():
        return None
    import psutil

    try:
        return psutil.Process(int(record["job_id"])).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False


def _age_s(status: Mapping[str, Any]) -> float:
    try:
        updated = dt.datetime.fromisoformat(str(status["updated"]))
    except (KeyError, ValueError):
        return float("inf")
    now = dt.datetime.now(updated.tzinfo) if updated.tzinfo else dt.datetime.now()
    return (now - updated).total_seconds()


def decide(status: Mapping[str, Any] | None, alive: bool | None, stale_s: float = STALE_S) -> str:
    """One of ``STATES`` from a run folder's status and its job's liveness (module docstring)."""
    state = (status or {}).get("state")
    if state == "done":
        return "done"
    if alive:
        return "running" if state == "running" else "pending"
    if status is None:
        return "missing"
    if state == "running" and alive is None and _age_s(status) < stale_s:
        return "running"
    return "failed"


def grid_states_of(specs: Sequence[RunSpec], registry: Mapping[str, Mapping[str, Any]],
                   stale_s: float = STALE_S) -> list[tuple[RunSpec, str]]:
    """``(spec, state)`` for ``specs``; the scheduler is asked only about runs not done."""
    statuses = {s.run_id: read_status(run_folder(s.config)) for s in specs}
    open_runs = {s.run_id: registry.get(s.run_id) for s in specs
                 if (statuses[s.run_id] or {}).get("state") != "done"}
    alive = jobs_alive(open_runs)
    return [(s, decide(statuses[s.run_id], alive.get(s.run_id), stale_s)) for s in specs]


def grid_states(grid: Grid, specs: list[RunSpec] | None = None,
                stale_s: float = STALE_S) -> list[tuple[RunSpec, str]]:
    """``(spec, state)`` for every run of a grid."""
    return grid_states_of(specs or expand(grid), read_registry(grid), stale_s)


def job_log(grid: Grid, record: Mapping[str, Any] | None) -> Path | None:
    """The error log of a registry record's job: the file the registry names
    (``.grid/logs/<job>_<task>_log.err``), else where grids submitted before it kept it
    (``.grid/submitit/<job>/<job>_0_log.err``)."""
    if not record:
        return None
    job = str(record.get("job_id"))
    path = (Path(record["log"]) if record.get("log") else
            grid.root / ".grid" / "submitit" / job / f"{job}_0_log.err")
    return path if path.is_file() else None


# lines that say why a job ended, most telling first: SLURM's kill notice, then a Python exception
_SLURM_NOTICE = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT \S+"
                           r"(?: DUE TO (?!JOB REQUEUE)[^*]+)? \*\*\*")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt|Exit)\b.*|.*Job not requeued.*")


def reason_from_log(text: str) -> str | None:
    """The line of a job log that says why the job ended, or None."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in (_SLURM_NOTICE, _EXCEPTION):
        hits = [line for line in lines if pattern.search(line)]
        if hits:
            return hits[-1]
    return None


def failure_reason(grid: Grid, spec: RunSpec, record: Mapping[str, Any] | None) -> str:
    """Why a run failed: the error its folder recorded, else the scheduler's final state and the
    telling line of its job's log."""
    status = read_status(run_folder(spec.config)) or {}
    if status.get("error"):
        return str(status["error"])
    parts = []
    if record and record.get("cluster") == "slurm":
        final = slurm_final_state(str(record["job_id"]))
        if final:
            parts.append(f"job {record['job_id']} {final}")
    log = job_log(grid, record)
    line = reason_from_log(log.read_text(errors="replace")) if log else None
    if line:
        parts.append(line)
    if status.get("state") in ("preempted", "running"):
        parts.append(f"stopped after round {status.get('round')} of {status.get('rounds')}")
    elif not status:
        parts.append("the run never started (no status.json)")
    return "; ".join(parts) or "no reason recorded"


def run_progress(folder: Path, status: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """How far the run in ``folder`` is: ``round``, ``rounds``, ``epsilon`` (so far), ``wer``
    (done runs) and ``eta_s`` (running runs: the rounds left times the mean of the last ten
    round times in the operator log); keys whose value is not known are left out."""
    from cluster_fl.engine.metrics import read_rows
    from cluster_fl.engine.operator_log import read_operator_log

    folder = Path(folder)
    status = status if status is not None else (read_status(folder) or {})
    out: dict[str, Any] = {k: status[k] for k in ("round", "rounds") if status.get(k) is not None}
    final = read_rows(folder / "final.parquet") if status.get("state") == "done" else []
    rows = final or read_rows(folder / "rounds.parquet")
    if rows and rows[-1].get("epsilon") is not None:
        out["epsilon"] = float(rows[-1]["epsilon"])
    if final and final[-1].get("wer") is not None:
        out["wer"] = float(final[-1]["wer"])
    if status.get("state") == "running" and out.get("rounds"):
        times = [float(e["wall_s"]) for e in read_operator_log(folder)
                 if e.get("event") == "round" and e.get("wall_s") is not None][-10:]
        if times:
            out["eta_s"] = (out["rounds"] - out.get("round", 0)) * sum(times) / len(times)
    return out


def progress_text(progress: Mapping[str, Any]) -> str:
    """``round 3/12, ETA 4:10, eps 88`` or ``WER 0.6583, eps 473``."""
    from cluster_fl.progress import format_duration

    parts = []
    if "wer" in progress:
        parts.append(f"WER {progress['wer']:.4f}")
    elif "rounds" in progress:
        parts.append(f"round {progress.get('round', 0)}/{progress['rounds']}")
        if "eta_s" in progress:
            parts.append(f"ETA {format_duration(progress['eta_s'])}")
    if "epsilon" in progress:
        eps = progress["epsilon"]
        parts.append(f"eps {eps:.3g}" if eps == eps and eps != float("inf") else "eps inf")
    return ", ".join(parts)


def format_states(states: list[tuple[RunSpec, str]]) -> str:
    """A per-cell table: counts per state and which seeds are in which state."""
    cells: dict[str, list[tuple[int, str]]] = {}
    for spec, state in states:
        cells.setdefault(spec.cell, []).append((spec.seed, state))
    width = max([len(c) for c in cells] + [4])
    lines = [f"{'cell':<{width}}  " + "  ".join(f"{s:>7}" for s in STATES) + "  seeds"]
    for cell, runs in cells.items():
        count = Counter(state for _, state in runs)
        seeds = " ".join(f"s{seed}:{state}" for seed, state in runs)
        lines.append(f"{cell:<{width}}  " + "  ".join(f"{count[s]:>7}" for s in STATES) + f"  {seeds}")
    total = Counter(state for _, state in states)
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{total[s]:>7}" for s in STATES)
                 + f"  ({len(states)} runs)")
    return "\n".join(lines)
