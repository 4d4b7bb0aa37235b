"""The run folder: where a run lives, how its files are written, and what state it is in.

``<run.out>/<run.experiment>/<run_id>/`` holds config.yaml, status.json, rounds.parquet,
final.parquet, eval.parquet, privacy.json, groups.json, checkpoint/ and log.txt. Every file is
written to a temporary name and renamed, so a crash never leaves a half-written file. A run whose
status is ``done`` is never rewritten.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from cluster_fl.config import Config, dump_config, to_dict

# Keys that do not change what a run computes, so they do not enter its id.
_BOOKKEEPING = {("run", "out"), ("run", "experiment"), ("run", "run_id"), ("run", "threads"),
                ("run", "checkpoint_every"), ("run", "timeout_s"), ("run", "wait_timeout_s"),
                ("run", "device"),
                # how a lane is laid out changes memory, not results (within float tolerance)
                ("model", "activation_checkpointing"), ("model", "shard"),
                ("model", "shard_group_size")}
# keys added after runs existed: left out of the id at their default, so old ids stay valid
_NEW_AT_DEFAULT = {("model", "dtype"): "float32"}


def run_id(cfg: Config) -> str:
    """Deterministic run id: readable prefix + hash of everything that affects results."""
    if cfg.run.run_id:
        return cfg.run.run_id
    tree = to_dict(cfg)
    for section, key in _BOOKKEEPING:
        tree[section].pop(key, None)
    for (section, key), default in _NEW_AT_DEFAULT.items():
        if tree[section].get(key) == default:
            tree[section].pop(key)
    digest = hashlib.sha1(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:8]
    method = "fedavg" if cfg.privacy.mechanism == "none" else cfg.privacy.clipping
    frozen = "frozen" if cfg.model.freeze_encoder else "unfrozen"
    return f"{cfg.model.arch}_{frozen}_{method}_s{cfg.run.seed}_{digest}"


def run_dir(cfg: Config) -> Path:
    """The folder of the run described by ``cfg``."""
    return Path(cfg.run.out).expanduser() / cfg.run.experiment / run_id(cfg)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file + fsync + rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_status(folder: Path) -> dict[str, Any] | None:
    """The run's status.json, or None when the run has not started."""
    path = Path(folder) / "status.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {"state": "failed", "error": "unreadable status.json"}


def write_status(folder: Path, state: str, round_: int, rounds: int,
                 error: str | None = None, **extra: Any) -> None:
    write_json(Path(folder) / "status.json", {
        "state": state, "round": round_, "rounds": rounds,
        "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "pid": os.getpid(), "error": error, **extra})


def is_done(folder: Path) -> bool:
    status = read_status(folder)
    return bool(status and status.get("state") == "done")


def write_config(folder: Path, cfg: Config) -> None:
    atomic_write_text(Path(folder) / "config.yaml", dump_config(cfg))


def git_commit() -> str:
    """The commit of the code that ran (``unknown`` outside a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        commit = out.stdout.strip()
        if out.returncode != 0 or not commit:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
