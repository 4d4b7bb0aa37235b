"""Stand-in SLURM client commands (``sinfo``, ``sbatch``, ``srun``) put first on PATH, so that
pre-flight's subprocess path runs for real without a cluster: each answers as SLURM 22.05 does
for the case a test sets up (a partition list, a controller that is down, a refused account)."""

from __future__ import annotations

import os
from pathlib import Path

DOWN = "sinfo: error: slurm_load_partitions: Unable to contact slurm controller (connect failure)"


def install(bin_dir: Path, monkeypatch, *, partitions: str = "debug*", sinfo_error: str = "",
            test_only_error: str = "", submit_error: str = "", gpus: int = 0) -> Path:
    """Write the fakes into ``bin_dir`` and put it first on PATH (monkeypatch undoes it)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    nodes = "\\n".join(f"n1|8|16000|{'gpu:%d' % gpus if gpus else '(null)'}|{p}"
                       for p in partitions.split())
    sinfo = (f'echo "{sinfo_error}" >&2; exit 1' if sinfo_error else
             f'case "$*" in *%N*) printf "{nodes}\\n";; *) echo "{partitions}" | tr " " "\\n";; esac')
    sbatch = f"""for a in "$@"; do
  if [ "$a" = "--test-only" ]; then
    {'echo "%s" >&2; exit 1' % test_only_error if test_only_error else
     'echo "sbatch: Job 1 to start at 2026-12-07T05:00:00 using 1 processors on nodes n1" >&2; exit 0'}
  fi
done
{'echo "%s" >&2; exit 1' % submit_error if submit_error else 'echo "Submitted batch job 42"'}
"""
    for name, body in (("sinfo", sinfo), ("sbatch", sbatch), ("srun", "exit 0")):
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body + "\n")
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir
