"""``cluster-fl train``: one experiment, from config to a finished run folder.

Runs in one process or under ``torchrun`` / ``srun`` (one rank per process). Rank 0 owns the run
folder: it writes the resolved config, the per-round metrics, the privacy ledger, checkpoints and
the final evaluation; every rank trains its shard of each cohort. Starting ``train`` on a folder
that holds a checkpoint resumes it; a finished run is left untouched.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cluster_fl.cli import add_config_arguments
from cluster_fl.config import Config, build_config, load_config, to_dict
from cluster_fl.engine import setup
from cluster_fl.engine.checkpoint import StopFlag, load_checkpoint, save_checkpoint
from cluster_fl.engine.metrics import read_rows, write_rows
from cluster_fl.dist.launch import launch_rank
from cluster_fl.engine.rundir import (git_commit, is_done, read_status, run_dir, write_config,
                                      write_json, write_status)
from cluster_fl.errors import UserError

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: checkpointed on a signal, resubmit to continue


class Log:
    """Rank-0 progress: one line per event to stderr and to the run's log.txt."""

    def __init__(self, folder: Path | None, enabled: bool):
        self.path = folder / "log.txt" if folder is not None else None
        self.enabled = enabled

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, file=sys.stderr, flush=True)
        if self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(line + "\n")


def _check_existing(folder: Path, cfg: Config) -> None:
    path = folder / "config.yaml"
    if not path.is_file():
        return
    import yaml

    old = to_dict(build_config(yaml.safe_load(path.read_text())))  # keys added later: defaults
    new = to_dict(cfg)
    for d in (old, new):  # bookkeeping keys may differ between submissions
        for k in ("threads", "timeout_s", "wait_timeout_s", "device", "out"):
            d.get("run", {}).pop(k, None)
        for k in ("activation_checkpointing", "shard", "shard_group_size"):
            d.get("model", {}).pop(k, None)
    if old != new:
        raise UserError(f"run folder {folder} holds a run with a different config; "
                        "set run.run_id or run.experiment to start a new run")


def run_training(cfg: Config, comm: Any = None) -> Path:
    """Run (or resume) the experiment ``cfg`` and return its run folder."""
    from cluster_fl import dist

    own_comm = comm is None
    comm = comm or dist.init_comm(timeout_s=cfg.run.timeout_s,
                                  wait_timeout_s=cfg.run.wait_timeout_s)
    folder = run_dir(cfg)
    main = comm.rank == 0
    try:
        if is_done(folder):
            if main:
                print(f"cluster-fl: run already finished: {folder}", file=sys.stderr)
            return folder
        if main:
            folder.mkdir(parents=True, exist_ok=True)
            _check_existing(folder, cfg)
            write_config(folder, cfg)
        comm.barrier(slow=True)  # waits for rank 0's file system
        log = Log(folder, main)
        return _train(cfg, comm, folder, log)
    finally:
        if own_comm:
            comm.close()


def _train(cfg: Config, comm: Any, folder: Path, log: Log) -> Path:
    setup.set_threads(cfg, comm)
    t_start = time.perf_counter()
    world = setup.build_world(cfg, comm, log)
    state = world.initial_state
    rows: list[dict] = []
    start_round = 1
    ckpt = load_checkpoint(folder)
    if ckpt is not None:  # checkpoints hold host tensors; the state lives on the model's device
        state = {k: v.to(world.placement.device) for k, v in ckpt["state"].items()}
        world.server.load_state_dict(ckpt["server"])
        world.policy_load(ckpt["policy"])
        world.ledger.load_state_dict(ckpt["ledger"])
        rows = [r for r in ckpt["rows"] if r["round"] <= ckpt["round"]]
        start_round = ckpt["round"] + 1
        log(f"resumed from round {ckpt['round']}")
    rounds = cfg.fl.rounds
    if comm.rank == 0:
        write_status(folder, "running", start_round - 1, rounds)
        write_json(folder / "groups.json", world.groups_json())
    with StopFlag() as stop:
        for r in range(start_round, rounds + 1):
            out = world.engine.run_round(r, state)
            state = out.state
            world.ledger.step_round()
            out.row["epsilon"] = world.ledger.epsilon()
            if cfg.eval.every and r % cfg.eval.every == 0 and r < rounds:
                summary, _ = world.evaluate(state)  # every rank decodes its slice
                if summary is not None:
                    out.row.update({k: v for k, v in summary.items() if k.startswith("wer")})
            rows.append(out.row)
            log(world.progress_line(r, rounds, out.row))
            stop_now = _agree(comm, stop.set)
            if comm.rank == 0:
                write_rows(folder / "rounds.parquet", rows)
                if r % cfg.run.checkpoint_every == 0 or r == rounds or stop_now:
                    save_checkpoint(folder, {
                        "round": r, "state": {k: v.cpu() for k, v in state.items()},
                        "server": world.server.state_dict(),
                        "policy": world.policy_state(), "ledger": world.ledger.state_dict(),
                        "rows": rows})
                write_status(folder, "running", r, rounds)
            comm.barrier(slow=True)  # waits for rank 0's checkpoint write
            if stop_now and r < rounds:
                if comm.rank == 0:
                    write_status(folder, "preempted", r, rounds)
                log(f"stopped by signal after round {r}; checkpoint saved, resubmit to resume")
                raise Preempted(folder)
    summary, eval_rows = world.evaluate(state)  # sharded over lanes; rank 0 gets the rows
    if comm.rank == 0:
        write_rows(folder / "eval.parquet", eval_rows)
        write_json(folder / "privacy.json", world.ledger.to_json())
        final = world.final_row(summary, time.perf_counter() - t_start, git_commit())
        write_rows(folder / "final.parquet", [final])
        write_status(folder, "done", rounds, rounds)
        log(f"done: WER {final.get('wer', float('nan')):.4f}, epsilon {final['epsilon']:.3g} -> {folder}")
    comm.barrier(slow=True)  # waits for rank 0's scoring and writes
    return folder


def _agree(comm: Any, flag: bool) -> bool:
    """True on every rank if any rank got a stop signal (ranks must stop at the same round)."""
    if comm.world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    comm.all_reduce_sum(t)
    return int(t.item()) > 0


class Preempted(Exception):
    """Raised after a signal-triggered checkpoint; the CLI exits with ``PREEMPTED_EXIT``."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    try:
        folder = run_training(cfg)
    except Preempted:
        return PREEMPTED_EXIT
    except Exception as exc:
        folder = run_dir(cfg)
        status = read_status(folder)
        if launch_rank() == 0 and folder.is_dir() and not isinstance(exc, UserError) \
                and (status or {}).get("state") != "done":
            write_status(folder, "failed", (status or {}).get("round", 0), cfg.fl.rounds,
                         error=f"{type(exc).__name__}: {exc}")
        raise
    if launch_rank() == 0:
        print(folder)
    return 0
