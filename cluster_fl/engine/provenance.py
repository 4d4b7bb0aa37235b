"""``provenance.json``: what a run started from and where each of its attempts ran.

A step budget makes a starting model independent of a machine's speed, not of its kernels: the
study's checkpoint rebuilt by the same recipe on an AMD EPYC core (AVX-512-BF16, no AMX) is
another model than the one an Intel core with AMX built (results/LOG.md, 2026-12-06), and a
federated run's float results differ between such machines too. So a run folder records

* ``starting_model``: the checkpoint it loads (``model.checkpoint``) and the SHA-256 of its
  ``model.pt`` (None for a run from random init or a checkpoint of another format), fixed by
  the first attempt: a resume whose checkpoint hashes differently stops with a one-line error
  instead of continuing a run on another model;
* ``attempts``: one entry per start or resume, in order -- host, CPU model and the instruction-set
  features that choose CPU kernels, the vector level ATen and inductor dispatch to and any
  environment cap on it (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
  ``MKL_ENABLE_INSTRUCTIONS``: a capped core computes like an older one), accelerator, torch
  version and the code's commit (threads: config.yaml's) -- so that tables can say which machine
  made which run (PROTOCOL.md §10).

Nothing here is computed from clients' data, and no time is kept (status.json's is the folder's
only one: cluster_fl/audit/record.py reads this file too).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

# torch is imported where it is used: engine/train.py imports this module before the stop
# handlers are installed, and importing torch takes seconds (a SIGTERM then exited 143)
from cluster_fl.config import Config
from cluster_fl.engine.rundir import git_commit, write_json
from cluster_fl.errors import UserError

FILE = "provenance.json"
# CPU features that change which kernels (and so which float results) torch and oneDNN use
_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16",
        "amx_int8", "asimd", "sve", "sve2")
# environment variables that cap the instruction set torch's kernel libraries use
_ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cpu() -> dict[str, Any]:
    """The CPU's model name, its kernel-relevant features (``/proc/cpuinfo`` on Linux), the vector
    level ATen dispatches to (``AVX512``, ``AVX2``, ...) and the environment's caps on it."""
    import torch

    name: str | None = None
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name is None:
                name = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    info: dict[str, Any] = {"model": name, "features": [f for f in _ISA if f in flags],
                            "dispatch": torch.backends.cpu.get_cpu_capability()}
    caps = {var: os.environ[var] for var in _ISA_CAPS if os.environ.get(var)}
    if caps:  # absent when nothing is capped
        info["caps"] = caps
    return info


def model_sha256(checkpoint: str | None) -> str | None:
    """SHA-256 of a cluster-fl checkpoint's ``model.pt``; None without one."""
    if not checkpoint:
        return None
    path = Path(checkpoint).expanduser() / "model.pt"
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def attempt(cfg: Config) -> dict[str, Any]:
    """This process's facts: where and with what this attempt of the run computes."""
    import torch

    device = cfg.run.device
    accelerator = (torch.cuda.get_device_name() if device.startswith("cuda")
                   and torch.cuda.is_available() else None)
    return {"host": socket.gethostname(), "cpu": cpu(), "device": device,
            "accelerator": accelerator, "torch": torch.__version__, "commit": git_commit()}


def record_attempt(folder: Path, cfg: Config) -> dict[str, Any]:
    """Append this attempt to ``folder``'s provenance (rank 0, holding the run's lock); a resume
    from a starting model other than the first attempt's is a :class:`UserError`."""
    path = Path(folder) / FILE
    sha = model_sha256(cfg.model.checkpoint)
    if path.exists():
        record = json.loads(path.read_text())
        first = record["starting_model"]["model_sha256"]
        if first != sha:
            raise UserError(
                f"{folder}: its starting model changed since the run began ({cfg.model.checkpoint}"
                f" model.pt SHA-256 {str(sha)[:16]}..., the run's is {str(first)[:16]}...): rerun "
                f"it in a new folder or restore the checkpoint it started from")
    else:
        record = {"format": 1, "starting_model": {"checkpoint": cfg.model.checkpoint,
                                                  "model_sha256": sha}, "attempts": []}
    record["attempts"].append(attempt(cfg))
    write_json(path, record)
    return record
