"""Stand-in SLURM commands (sbatch, srun, squeue, sacct, scontrol, scancel) for tests without SLURM.

``install(tmp)`` writes executable scripts into ``tmp/bin`` (put it first on PATH) that keep their
state in ``tmp/slurm``. ``sbatch FILE`` records the script, answers "Submitted batch job N" and
starts a background runner that executes every array task of FILE one after another with the
SLURM_* variables set; ``srun`` runs its command; ``scontrol requeue ID`` marks a task requeued, and
the runner runs it again after its process exits (as SLURM does after a preemption), with
SLURM_RESTART_COUNT incremented. ``squeue -j ID`` reports RUNNING/PENDING tasks and "Invalid job id"
for finished ones, like the real one. Task states live in ``tmp/slurm/state/<job>_<task>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

COMMON = f"""#!{sys.executable}
import os, re, subprocess, sys, time
from pathlib import Path
STATE = Path({{root!r}})
(STATE / "state").mkdir(parents=True, exist_ok=True)
def log(line):
    with open(STATE / "calls.log", "a") as fh:
        fh.write(line + "\\n")
log(" ".join([Path(sys.argv[0]).name] + sys.argv[1:]))
"""

SBATCH = """
script = Path(sys.argv[-1]).read_text()
counter = STATE / "counter"
job = int(counter.read_text()) + 1 if counter.exists() else 1000
counter.write_text(str(job))
(STATE / f"sbatch_{job}.sh").write_text(script)
m = re.search(r"#SBATCH --array=0-(\\d+)", script)
n = int(m.group(1)) + 1 if m else 1
for a in range(n):
    (STATE / "state" / f"{job}_{a}").write_text("PENDING")
subprocess.Popen([sys.executable, str(Path(sys.argv[0]).parent / "fake_runner"), str(job), str(n),
                  sys.argv[-1]], start_new_session=True,
                 stdout=open(STATE / f"runner_{job}.log", "a"), stderr=subprocess.STDOUT)
print(f"Submitted batch job {job}")
"""

RUNNER = """
job, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for a in range(n):
    tid, restarts = f"{job}_{a}", 0
    while True:
        (STATE / "state" / tid).write_text("RUNNING")
        env = dict(os.environ, SLURM_JOB_ID=str(int(job) + 1 + a), SLURM_ARRAY_JOB_ID=job,
                   SLURM_ARRAY_TASK_ID=str(a), SLURM_PROCID="0", SLURM_LOCALID="0",
                   SLURM_NODEID="0", SLURM_NTASKS="1", SLURM_JOB_NUM_NODES="1",
                   SLURM_JOB_NODELIST="localhost", SLURM_RESTART_COUNT=str(restarts))
        rc = subprocess.call(["bash", path], env=env)
        flag = STATE / "state" / f"{tid}.requeue"
        if flag.exists():
            flag.unlink()
            restarts += 1
            log(f"runner: task {tid} exited {rc}, requeued")
            continue
        (STATE / "state" / tid).write_text("COMPLETED" if rc == 0 else "FAILED")
        log(f"runner: task {tid} exited {rc}")
        break
"""

SRUN = """
args = sys.argv[1:]
while args and args[0].startswith("-"):  # --unbuffered, --output X, --error Y
    opt = args.pop(0)
    if opt in ("--output", "--error") and args:
        args.pop(0)
os.execvp(args[0], args)
"""

SCONTROL = """
if sys.argv[1] == "requeue":
    (STATE / "state" / f"{sys.argv[2]}.requeue").write_text("1")
elif sys.argv[1:3] == ["show", "hostnames"]:
    print("localhost")
"""

SQUEUE = """
ids = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "-j"]
live = []
for jid in ids:
    for f in sorted((STATE / "state").glob(jid if "_" in jid else f"{jid}_*")):
        if f.suffix != ".requeue" and f.read_text() in ("PENDING", "RUNNING"):
            live.append(f.read_text())
if not live:
    print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
    sys.exit(1)
print("\\n".join(live))
"""

SACCT = """
ids = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "-j"]
print("JobID|State|NodeList")
for jid in ids:
    for f in sorted((STATE / "state").glob(f"{jid}_*")):
        if f.suffix != ".requeue":
            print(f"{f.name}|{f.read_text()}|localhost")
"""

SCANCEL = "pass\n"


def install(tmp: Path) -> tuple[Path, Path]:
    """Write the fake commands; return (bin folder for PATH, state folder)."""
    bin_dir, state = tmp / "bin", tmp / "slurm"
    bin_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    scripts = {"sbatch": SBATCH, "fake_runner": RUNNER, "srun": SRUN, "scontrol": SCONTROL,
               "squeue": SQUEUE, "sacct": SACCT, "scancel": SCANCEL}
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(COMMON.format(root=str(state)) + body)
        path.chmod(0o755)
    return bin_dir, state


def task_states(state: Path) -> dict[str, str]:
    """Current state of every fake array task."""
    return {f.name: f.read_text() for f in (state / "state").iterdir() if f.suffix != ".requeue"}
