"""Crafted run folders in the engine's documented format, and a stand-in training function.

``write_run`` writes exactly the files the experiments tools read (status.json, final.parquet,
eval.parquet, rounds.parquet, groups.json, config.yaml); ``fake_train`` is an injectable training
callable with the engine's contract (resume from the run folder, idempotent, returns the folder)
whose results are a known function of the config, so tests can check what the tools report.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from cluster_fl.config import Config, dump_config, to_dict


def now() -> str:
    return dt.datetime.now().isoformat(timespec="seconds")


def write_status(folder: Path, state: str, round_: int, rounds: int, error: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "status.json.tmp"
    tmp.write_text(json.dumps({"state": state, "round": round_, "rounds": rounds,
                               "updated": now(), "error": error}))
    os.replace(tmp, folder / "status.json")


def write_table(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    pq.write_table(pa.Table.from_pylist(list(rows)), path)


GROUPS = [
    {"name": "connector.proj.weight", "component": "connector", "numel": 4096, "pool": "decoder"},
    {"name": "decoder.l0.q.lora_A", "component": "decoder", "numel": 256, "pool": "decoder"},
    {"name": "decoder.l0.q.lora_B", "component": "decoder", "numel": 256, "pool": "decoder"},
    {"name": "encoder.l0.q.lora_A", "component": "encoder", "numel": 128, "pool": "encoder"},
    {"name": "encoder.l0.q.lora_B", "component": "encoder", "numel": 128, "pool": "encoder"},
]
GROUP_NORMS = {"connector": 0.5, "decoder": 0.15, "encoder": 0.015}


def write_run(folder: Path, *, arch: str = "whisper-tinyllama-tiny", freeze_encoder: bool = False,
              method: str = "flat", alpha: float = 0.05, seed: int = 0, wer: float = 0.2,
              epsilon: float = 3.0, sigma: float = 0.1, clip: float = 1.0, rounds: int = 3,
              n_clients: int = 4, eval_rows: Sequence[dict[str, Any]] | None = None,
              pools: Sequence[str] = ("all",), experiment: str = "test") -> Path:
    """A finished run folder with the given headline numbers."""
    folder.mkdir(parents=True, exist_ok=True)
    share = {"encoder": alpha, "decoder": 1 - alpha, "all": 1.0}
    final = {"run_id": folder.name, "experiment": experiment, "arch": arch,
             "freeze_encoder": freeze_encoder, "method": method, "alpha": alpha, "seed": seed,
             "noise_multiplier": sigma, "clip_norm": clip, "epsilon": epsilon, "delta": 1e-5,
             "wer": wer, "wer_ci_low": wer - 0.01, "wer_ci_high": wer + 0.01, "cer": wer / 2,
             "rounds": rounds, "wall_s": 1.0, "git_commit": "abc", "config_json": "{}"}
    for p in pools:
        final[f"sigma/{p}"] = sigma / math.sqrt(share.get(p, 1.0))
    write_table(folder / "final.parquet", [final])
    if eval_rows is None:
        eval_rows = [{"utt_id": f"u{i}", "speaker": f"spk{i % 2}", "language": "en", "ref": "a b",
                      "hyp": "a b", "word_errors": 0, "ref_words": 2, "char_errors": 0,
                      "ref_chars": 3} for i in range(4)]
    write_table(folder / "eval.parquet", eval_rows)
    rows = []
    for r in range(1, rounds + 1):
        row = {"round": r, "loss": 1.0 / r, "n_clients": n_clients, "n_skipped": 0,
               "n_nonfinite": 0, "wall_s": 0.1, "epsilon": epsilon * r / rounds,
               "total_norm": 0.6 / r, "clip_rate": 0.9 / r}
        for p in pools:
            row.update({f"clip_rate/{p}": 0.8 / r, f"retained/{p}": 0.5 + 0.1 * r,
                        f"mean_norm/{p}": 0.3 / r, f"threshold/{p}": math.sqrt(share.get(p, 1.0)) * clip})
        for g in GROUPS:
            row[f"norm/{g['name']}"] = GROUP_NORMS[g["component"]] / r
            row[f"threshold/{g['name']}"] = 0.1
        rows.append(row)
    write_table(folder / "rounds.parquet", rows)
    (folder / "groups.json").write_text(json.dumps([{**g, "threshold": 0.1} for g in GROUPS]))
    write_status(folder, "done", rounds, rounds)
    return folder


def fake_wer(cfg: Config) -> float:
    """The WER the fake training reports: a known function of method and seed."""
    base = {"none": 0.10, "flat": 0.20, "size": 0.30, "alpha-split": 0.25}
    method = "none" if cfg.privacy.mechanism == "none" else cfg.privacy.clipping
    return base.get(method, 0.5) + 0.01 * cfg.run.seed


class Preempted(Exception):
    """Same name as the engine's: raised after a signal-triggered checkpoint."""


def fake_train(cfg: Config) -> Path:
    """Stand-in for ``run_training``: one status.json beat per round, resumable, idempotent.
    With ``CFL_FAKE_PREEMPT_AT=k`` in the environment it sends itself SIGUSR2 after round k
    on its first attempt (a marker file remembers the attempt), as SLURM does before a preemption."""
    folder = Path(cfg.run.out) / cfg.run.experiment / str(cfg.run.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    status = {}
    if (folder / "status.json").is_file():
        status = json.loads((folder / "status.json").read_text())
        if status["state"] == "done":
            return folder
    start = int(status.get("round", 0))
    with open(folder / "attempts.txt", "a") as fh:
        fh.write(f"start {start}\n")
    preempt_at = int(os.environ.get("CFL_FAKE_PREEMPT_AT", "0"))
    stop: list[int] = []
    # like the engine's StopFlag: own SIGUSR2 while training, stop at the next round boundary
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: stop.append(signum))
    try:
        for r in range(start + 1, cfg.fl.rounds + 1):
            write_status(folder, "running", r, cfg.fl.rounds)  # "checkpoint" after round r
            if r == preempt_at and not (folder / "preempted").exists():
                (folder / "preempted").write_text("1")
                os.kill(os.getpid(), signal.SIGUSR2)  # what SLURM sends before a preemption
                time.sleep(0.05)
            if stop and r < cfg.fl.rounds:
                write_status(folder, "preempted", r, cfg.fl.rounds)
                raise Preempted(str(folder))
    finally:
        signal.signal(signal.SIGUSR2, previous)
    (folder / "config.yaml").write_text(dump_config(cfg))
    method = "none" if cfg.privacy.mechanism == "none" else cfg.privacy.clipping
    write_run(folder, arch=cfg.model.arch, freeze_encoder=cfg.model.freeze_encoder, method=method,
              alpha=cfg.privacy.alpha, seed=cfg.run.seed, wer=fake_wer(cfg),
              rounds=cfg.fl.rounds, experiment=cfg.run.experiment)
    (folder / "config.json").write_text(json.dumps(to_dict(cfg)))
    return folder
