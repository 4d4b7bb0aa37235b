"""One experiment, from config to a finished run folder (``cluster-fl train`` runs it).

Runs in one process or under ``torchrun`` / ``srun`` (one rank per process). Rank 0 owns the run
folder: it holds the folder's lock for the run's life (one writer per run; a second ``train`` on
a live run stops with one line naming the holder), writes the resolved config, the per-round
metrics, the privacy ledger, checkpoints and the final evaluation; every rank trains its shard of
each cohort. Starting ``train`` on a folder that holds a checkpoint resumes it; a finished run is
left untouched.

How a run ends, whatever happens: ``done`` (exit 0); a stop signal (SIGTERM, SIGUSR2) at any
point -- setup, a round, the final evaluation -- leaves the last checkpoint, status ``preempted``
and exit 75; a problem the user can fix (a config key, an unreadable file, a full disk, no client
ever contributing) is one line naming the file or key, status ``failed`` with that line, exit 2.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

# Light imports only: torch, models and data are imported inside the functions, after the stop
# handlers are installed, so that a SIGTERM during start-up is a clean stop too (exit 75).
from cluster_fl.config import Config, build_config, to_dict, yaml_load
from cluster_fl.engine.checkpoint import StopFlag, Stopped, load_run_checkpoint, save_run_checkpoint
from cluster_fl.engine.rundir import (RESUME_TOLERATED, RunLock, append_text, clean_temp_files,
                                      git_commit, is_done, make_folder, read_status, run_dir,
                                      write_config, write_json, write_status)
from cluster_fl.errors import UserError

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: checkpointed on a signal, resubmit to continue
# OS errors that describe the machine, not the code: reported as one line (exit 2)
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES,
                       errno.EPERM, errno.ENOTDIR, errno.EISDIR}


class Log:
    """Rank-0 progress: one line per event to stderr and to the run's log.txt."""

    def __init__(self, folder: Path | None, enabled: bool):
        self.path = folder / "log.txt" if folder is not None else None
        self.enabled = enabled

    def __call__(self, msg: str, echo: bool = True) -> None:
        if not self.enabled:
            return
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if echo:
            print(line, file=sys.stderr, flush=True)
        if self.path is not None:
            append_text(self.path, line + "\n")


def _check_existing(folder: Path, cfg: Config) -> None:
    path = folder / "config.yaml"
    if not path.is_file():
        return
    try:
        old = to_dict(build_config(yaml_load(path.read_text())))  # keys added later: defaults
    except Exception as exc:  # noqa: BLE001 - a damaged config.yaml is the user's to fix
        raise UserError(f"{path} is unreadable ({type(exc).__name__}); restore it, or delete "
                        f"{folder} to start the run again") from None
    new = to_dict(cfg)
    for d in (old, new):  # bookkeeping keys may differ between submissions
        for section, key in RESUME_TOLERATED:
            d.get(section, {}).pop(key, None)
    if old != new:
        keys = [f"{sec}.{k}" for sec in new for k in new[sec]
                if old.get(sec, {}).get(k) != new[sec][k]]
        damaged = "" if path.read_bytes().endswith(b"\n") else " (the file looks truncated)"
        raise UserError(f"run folder {folder} holds a run with a different config "
                        f"({path} differs in {', '.join(keys[:3])}{damaged}); set run.run_id "
                        "or run.experiment to start a new run")


def run_training(cfg: Config, comm: Any = None) -> Path:
    """Run (or resume) the experiment ``cfg`` and return its run folder.

    Raises :class:`Preempted` after a stop signal (the folder is resumable) and
    :class:`~cluster_fl.errors.UserError` for problems the user can fix; either way rank 0 has
    recorded the outcome in status.json.
    """
    folder = run_dir(cfg)
    # From the first moment: a signal during setup or evaluation stops at once (Stopped), one
    # during a round stops at the round's end (the loop makes the flag deferred).
    with StopFlag(immediate=True) as stop:
        try:
            return _run(cfg, comm, folder, stop)
        except Stopped:
            raise Preempted(folder) from None


def _run(cfg: Config, comm: Any, folder: Path, stop: StopFlag) -> Path:
    from cluster_fl import dist

    own_comm = comm is None
    comm = comm or dist.init_comm(timeout_s=cfg.run.timeout_s,
                                  wait_timeout_s=cfg.run.wait_timeout_s)
    main = comm.rank == 0
    lock: RunLock | None = None
    log = Log(folder, False)
    progress = {"checkpoint_round": 0, "owned": False}
    try:
        finished, lock, removed = _open_run(cfg, comm, folder)
        if finished:
            return folder
        progress["owned"] = True
        log = Log(folder, main)
        if removed:
            log(f"removed {len(removed)} temporary file(s) an interrupted writer left: "
                + ", ".join(p.name for p in removed))
        if lock is not None and not lock.enforced:
            log(f"warning: the file system of {folder} has no locks; a second writer is "
                "detected only on this host")
        return _train(_working_config(cfg, comm, folder), comm, folder, log, stop, progress,
                      record=cfg)
    except BaseException as exc:
        stopped = isinstance(exc, Stopped) or (stop.set and isinstance(exc, Exception)
                                               and not isinstance(exc, Preempted))
        if main and progress["owned"]:
            _record_end(folder, cfg, exc, stopped, progress["checkpoint_round"], log)
        if stopped:
            raise Preempted(folder) from None
        if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT_ERRNOS:
            where = f"{exc.filename}: " if exc.filename else ""
            raise UserError(f"{where}{exc.strerror or exc}") from None
        raise
    finally:
        if lock is not None:
            lock.release()
        if own_comm:
            comm.close()


_DONE = "done"


def _open_run(cfg: Config, comm: Any, folder: Path
              ) -> tuple[bool, RunLock | None, list[Path]]:
    """Rank 0 takes the folder (lock, checks, config) and tells every rank what it found: the run
    is finished (``finished`` everywhere), cannot start (every rank raises the same one-line
    error), or goes ahead (rank 0 gets the lock and the temporary files it removed)."""
    lock, outcome, error, removed = None, "run", None, []
    if comm.rank == 0:
        try:
            if is_done(folder):  # done runs are never rewritten, not even their lock file
                outcome = _DONE
            else:
                make_folder(folder)
                lock = RunLock(folder).acquire()
                if is_done(folder):  # finished while we waited for the lock
                    outcome = _DONE
                else:
                    _check_existing(folder, cfg)
                    removed = clean_temp_files(folder)  # what a killed writer left half-written
                    write_config(folder, cfg)
        except UserError as exc:
            outcome, error = "error", exc
        except BaseException:  # a stop signal while taking the folder
            if lock is not None:
                lock.release()
            raise
        if outcome != "run" and lock is not None:
            lock.release()
            lock = None
    shared = outcome if error is None else f"error: {error}"
    if comm.world_size > 1:
        shared = comm.broadcast_object(shared if comm.rank == 0 else None)
    if error is not None:
        raise error
    if shared.startswith("error: "):
        raise UserError(shared[len("error: "):])
    if shared == _DONE:
        if comm.rank == 0:
            print(f"cluster-fl: run already finished: {folder}", file=sys.stderr)
        return True, None, []
    return False, lock, removed


def _working_config(cfg: Config, comm: Any, folder: Path) -> Config:
    """The config the engine runs. Secure mode has no seed: rank 0 draws one from the OS at
    every start (every rank gets it) for cohort sampling and client randomness; it is never
    written anywhere, and the run keeps its folder (``run_id`` pinned to it)."""
    if not cfg.privacy.secure_mode:
        return cfg
    seed = secrets.randbits(63) if comm.rank == 0 else None
    if comm.world_size > 1:
        seed = comm.broadcast_object(seed)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed,
                                                            run_id=folder.name))


def _record_end(folder: Path, cfg: Config, exc: BaseException, stopped: bool,
                checkpoint_round: int, log: Log) -> None:
    """Rank 0, holding the lock: status.json says how the run ended (best effort: on a full or
    read-only disk this may fail too, and the one-line error still reaches the user)."""
    if isinstance(exc, Preempted):
        return  # the round loop recorded it
    status = read_status(folder) or {}
    if status.get("state") == "done":
        return
    try:
        if stopped:
            write_status(folder, "preempted", checkpoint_round, cfg.fl.rounds)
            log("stopped by signal " + (f"after the checkpoint of round {checkpoint_round}"
                                        if checkpoint_round else "before the first round")
                + "; nothing is lost, resubmit to resume")
            return
        if isinstance(exc, UserError):
            reason = str(exc)
        elif isinstance(exc, KeyboardInterrupt):
            reason = "interrupted"
        else:
            reason = f"{type(exc).__name__}: {exc}"
        write_status(folder, "failed", status.get("round", checkpoint_round), cfg.fl.rounds,
                     error=reason)
        log(f"failed: {reason}", echo=False)  # the CLI prints the one-line error itself
    except (UserError, OSError):
        pass


def _train(cfg: Config, comm: Any, folder: Path, log: Log, stop: StopFlag,
           progress: dict, record: Config) -> Path:
    from cluster_fl.engine import setup
    from cluster_fl.engine.metrics import SkippedRows, progress_line, write_rows

    main = comm.rank == 0
    setup.set_threads(cfg, comm)
    t_start = time.perf_counter()
    world = setup.build_world(cfg, comm, log)
    skipped = SkippedRows(folder, world.evaluation.store.errors, _owners(world.engine.clients),
                          main, log)
    state = world.initial_state
    rows: list[dict] = []
    start_round = 1
    ckpt = load_run_checkpoint(folder)
    if ckpt is not None:  # checkpoints hold host tensors; the state lives on the model's device
        state = {k: v.to(world.placement.device) for k, v in ckpt["state"].items()}
        world.server.load_state_dict(ckpt["server"])
        world.policy_load(ckpt["policy"])
        world.ledger.load_state_dict(ckpt["ledger"])
        rows = [r for r in ckpt["rows"] if r["round"] <= ckpt["round"]]
        start_round = ckpt["round"] + 1
        progress["checkpoint_round"] = ckpt["round"]
        log(f"resumed from round {ckpt['round']}")
    rounds = cfg.fl.rounds
    if main:
        write_status(folder, "running", start_round - 1, rounds)
        write_json(folder / "groups.json", world.groups_json())
    skipped.collect(comm)
    stop.set_immediate(False)  # from here a signal stops at the end of the round
    for r in range(start_round, rounds + 1):
        out = world.engine.run_round(r, state)
        state = out.state
        world.ledger.step_round()
        out.row["epsilon"] = world.ledger.epsilon()
        if cfg.eval.every and r % cfg.eval.every == 0 and r < rounds:
            summary, _ = world.evaluate(state)  # every rank decodes its slice
            if summary is not None:
                out.row.update({k: v for k, v in summary.items() if k.startswith("wer")})
                from cluster_fl.engine.evaluation import evaluation_line
                log(evaluation_line(r, rounds, summary))  # readable where diagnostics are not
        rows.append(out.row)
        log(progress_line(r, rounds, out.row))
        if out.row.get("empty"):
            log(f"warning: round {r}: no client contributed ("
                + ("Poisson sampling drew no client" if not out.row.get("n_cohort") else
                   f"all {out.row['n_cohort']} sampled clients had non-finite updates or no "
                   "usable audio") + "); the update was noise only")
        skipped.collect(comm)
        stop_now = _agree(comm, stop.set)
        if main:
            write_rows(folder / "rounds.parquet", rows)
            if r % cfg.run.checkpoint_every == 0 or r == rounds or stop_now:
                save_run_checkpoint(folder, {
                    "round": r, "state": {k: v.cpu() for k, v in state.items()},
                    "server": world.server.state_dict(),
                    "policy": world.policy_state(), "ledger": world.ledger.state_dict(),
                    "rows": rows})
                progress["checkpoint_round"] = r
            write_status(folder, "running", r, rounds)
        comm.barrier(slow=True)  # waits for rank 0's checkpoint write
        if stop_now and r < rounds:
            if main:
                write_status(folder, "preempted", r, rounds)
            log(f"stopped by signal after round {r}; checkpoint saved, resubmit to resume")
            raise Preempted(folder)
    empty = sum(int(bool(r.get("empty"))) for r in rows)
    if rows and empty == len(rows):
        raise UserError(f"no client contributed in any of the {len(rows)} rounds (every update "
                        "non-finite or without usable audio): the model learned nothing; e.g. "
                        "lower fl.lr or the client.lr_*_mult keys, or check data.corpus")
    stop.set_immediate(True)  # the final evaluation: a signal stops it at once
    summary, eval_rows = world.evaluate(state)  # sharded over lanes; rank 0 gets the rows
    stop.set_immediate(False)  # the last writes take a moment: let them finish
    skipped.collect(comm)
    if main:
        write_rows(folder / "eval.parquet", eval_rows)
        write_json(folder / "privacy.json", world.ledger.to_json())
        final = world.final_row(summary, time.perf_counter() - t_start, git_commit())
        final.update(empty_rounds=empty, skipped_utterances=skipped.total)
        if record.privacy.secure_mode:  # the drawn seed is no part of the record
            final.update(seed=None, config_json=json.dumps(to_dict(record), sort_keys=True))
        write_rows(folder / "final.parquet", [final])
        write_status(folder, "done", rounds, rounds)
        log(f"done: WER {final.get('wer', float('nan')):.4f}, epsilon {final['epsilon']:.3g} -> {folder}")
    comm.barrier(slow=True)  # waits for rank 0's scoring and writes
    return folder


def evaluate_start(cfg: Config) -> tuple[dict, list[dict]]:
    """(summary, rows) of the model a run of ``cfg`` starts from -- round 0, before any client
    trains -- on the run's evaluation set, by the run's own evaluation (one process): the
    baseline federated training is measured against."""
    from cluster_fl.dist import LocalComm
    from cluster_fl.engine import setup

    comm = LocalComm()
    setup.set_threads(cfg, comm)
    world = setup.build_world(cfg, comm, Log(None, False))
    summary, rows = world.evaluate(world.initial_state)
    return summary or {}, rows or []


def _owners(clients: Any) -> dict[str, str]:
    """utterance id -> client id, for counting skipped rows per client."""
    owner = {}
    for c in clients:
        meta = getattr(getattr(c, "utterances", None), "client", None)
        for u in getattr(meta, "utterances", []):
            owner[u.utterance_id] = c.client_id
    return owner


def _agree(comm: Any, flag: bool) -> bool:
    """True on every rank if any rank got a stop signal (ranks must stop at the same round)."""
    if comm.world_size == 1:
        return flag
    import torch

    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    comm.all_reduce_sum(t)
    return int(t.item()) > 0


class Preempted(Exception):
    """Raised after a stop signal, the state checkpointed; the CLI exits with ``PREEMPTED_EXIT``."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = folder

