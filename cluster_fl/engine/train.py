"""One experiment, from config to a finished run folder (``cluster-fl train`` runs it).

Runs in one process or under ``torchrun`` / ``srun`` (one rank per process). Rank 0 owns the run
folder: it holds the folder's lock for the run's life (one writer per run; a second ``train`` on
a live run stops with one line naming the holder), writes the resolved config, the per-round
metrics, the privacy ledger, checkpoints and the final evaluation; every rank trains its shard of
each cohort. Starting ``train`` on a folder that holds a checkpoint resumes it; a finished run is
left untouched.

How a run ends, whatever happens: ``done`` (exit 0); a stop signal (SIGTERM, SIGUSR2) at any
point -- setup, a round, the final evaluation -- leaves the last checkpoint, status ``preempted``
and exit 75 (a second signal while stopping changes neither); a problem the user can fix (a config
key, an unreadable or foreign file in the run folder, a checkpoint that fails its verification, a
full disk, no client ever contributing to a run whose diagnostics are released exactly) is one
line naming the file or key, status ``failed`` with that line, exit 2.

What the run folder releases (DESIGN §13): public or noised values only. The privacy ledger
(``privacy.json``) is charged and written durably before each round's noise is drawn
(:mod:`cluster_fl.engine.ledger`); the exact facts of each round (realised cohort, clients
trained / non-finite / without audio, wall time, time of day) and the unusable corpus rows go
to the operator log outside the folder (:mod:`cluster_fl.engine.operator_log`); log.txt holds
the released lines without times.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
import errno
import faulthandler
import json
import secrets
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

# Light imports only: torch, models and data are imported inside the functions, after the stop
# handlers are installed, so that a SIGTERM during start-up is a clean stop too (exit 75).
from cluster_fl.config import Config, build_config, to_dict, yaml_load
from cluster_fl.engine.budget import over_budget, resolve_sigma, start_notes
from cluster_fl.engine.checkpoint import (StopFlag, Stopped, check_checkpoint_path,
                                          load_run_checkpoint, save_run_checkpoint)
from cluster_fl.engine.dataset_ledger import DatasetLedger
from cluster_fl.engine.operator_log import OperatorLog, new_job_secret, read_job_secret
from cluster_fl.engine.provenance import record_attempt
from cluster_fl.engine.rundir import (RESUME_TOLERATED, RunLock, clean_temp_files,
                                      flatten_times, git_commit, is_done, make_folder,
                                      path_names, read_status, run_dir, write_config, write_json,
                                      write_status)
from cluster_fl.errors import UserError
from cluster_fl.engine.watch import Log, Watch

if TYPE_CHECKING:  # imported lazily at run time: the process boundary starts with the run
    from cluster_fl.distributed import Comm

# OS errors that describe the machine, not the code: reported as one line (exit 2)
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES,
                       errno.EPERM, errno.ENOTDIR, errno.EISDIR}


def _check_existing(folder: Path, cfg: Config) -> tuple[bool, str | None, float | None]:
    """Refuse a folder whose config.yaml describes another run; return (whether the folder has
    a config, the run's nonce in it -- None for a run from before nonces --, the σ it ran with)."""
    path = folder / "config.yaml"
    if not path.is_file():
        return False, None, None
    try:
        # keys added later: defaults; the stored config was resolved at its run's entrance
        old = to_dict(build_config(yaml_load(path.read_text())))
    except Exception as exc:  # noqa: BLE001 - a damaged config.yaml is the user's to fix
        raise UserError(f"{path} is unreadable ({type(exc).__name__}); restore it, or delete "
                        f"{folder} to start the run again") from None
    new = to_dict(cfg)
    nonce = old.get("run", {}).get("nonce")
    sigma = old.get("privacy", {}).get("noise_multiplier")
    if cfg.run.nonce is not None and cfg.run.nonce != nonce:
        raise UserError(f"run folder {folder} holds another run (run.nonce {nonce!r} in {path}, "
                        f"not {cfg.run.nonce!r}); leave run.nonce unset")
    for d in (old, new):  # bookkeeping keys may differ between submissions, and the folders
        path_names(d)     # that hold the same corpus and checkpoint (the id's comparison)
        for section, key in RESUME_TOLERATED | {("run", "nonce")}:
            d.get(section, {}).pop(key, None)
        if cfg.privacy.noise_multiplier is None:  # σ derived from the target at the first start
            d.get("privacy", {}).pop("noise_multiplier", None)
    if old != new:
        keys = [f"{sec}.{k}" for sec in new for k in new[sec]
                if old.get(sec, {}).get(k) != new[sec][k]]
        damaged = "" if path.read_bytes().endswith(b"\n") else " (the file looks truncated)"
        raise UserError(f"run folder {folder} holds a run with a different config "
                        f"({path} differs in {', '.join(keys[:3])}{damaged}); set run.run_id "
                        "or run.experiment to start a new run")
    return True, nonce, sigma


def dump_stacks_on_fatal_signal() -> bool:
    """A fatal signal in native code (a compiled kernel, a library) ends the process before any
    Python handler runs: have it dump every thread's Python stack to stderr (the job's log)
    first, so the crash names its layer and op (the 2026-12-05 segfault in an inductor kernel left
    a log that ended at the run's header). False where stderr is not a file (a notebook)."""
    if faulthandler.is_enabled():
        return True
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, OSError, RuntimeError):
        return False
    return True


def run_training(cfg: Config, comm: Comm | None = None) -> Path:
    """Run (or resume) the experiment ``cfg`` and return its run folder.

    Raises :class:`Preempted` after a stop signal (the folder is resumable) and
    :class:`~cluster_fl.errors.UserError` for problems the user can fix; either way rank 0 has
    recorded the outcome in status.json.
    """
    from cluster_fl.models.registry import resolve_shapes  # JSON only: data.n_mels of the model

    cfg = resolve_shapes(cfg)  # the run's entrance: the one place a run's config is resolved
    folder = run_dir(cfg)
    dump_stacks_on_fatal_signal()
    # From the first moment: a signal during setup or evaluation stops at once (Stopped), one
    # during a round stops at the round's end (the loop makes the flag deferred).
    with StopFlag(immediate=True) as stop, quiet_data_warnings(cfg):
        try:
            return _run(cfg, comm, folder, stop)
        except Stopped:
            raise Preempted(folder) from None


@contextlib.contextmanager
def quiet_data_warnings(cfg: Config) -> Iterator[None]:
    """In a private run, the corpus reader's ``skipping utterance <id>`` warnings do not reach
    stderr (a scheduler's job log): the unusable rows are the operator log's (skipped.json)."""
    with warnings.catch_warnings():
        if _private(cfg):
            warnings.filterwarnings("ignore", message="skipping utterance")
        yield


def _private(cfg: Config) -> bool:
    """A DP run: its stderr, log.txt and status.json carry no exact facts of the clients."""
    return cfg.privacy.mechanism != "none"


def _run(cfg: Config, comm: Comm | None, folder: Path, stop: StopFlag) -> Path:
    from cluster_fl import distributed as dist

    own_comm = comm is None
    comm = comm or dist.init_comm(timeout_s=cfg.run.timeout_s,
                                  wait_timeout_s=cfg.run.wait_timeout_s)
    main = comm.rank == 0
    lock: RunLock | None = None
    log = Log(folder, False)
    progress = {"checkpoint_round": 0, "owned": False}
    try:
        finished, lock, removed, nonce, sigma = _open_run(cfg, comm, folder)
        if finished:
            return folder
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, nonce=nonce),
                                  privacy=dataclasses.replace(cfg.privacy,
                                                              noise_multiplier=sigma))
        progress["owned"] = True
        log = Log(folder, main, stamp=not _private(cfg))
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


def _open_run(cfg: Config, comm: Comm, folder: Path
              ) -> tuple[bool, RunLock | None, list[Path], str | None, float | None]:
    """Rank 0 takes the folder (lock, checks, config) and tells every rank what it found: the run
    is finished (``finished`` everywhere; only for the same config), cannot start (every rank
    raises the same one-line error), or goes ahead (rank 0 gets the lock and the temporary files
    it removed; every rank the run's nonce: drawn at the first start, then the folder's)."""
    lock, outcome, error, removed, nonce = None, "run", None, [], None
    sigma = cfg.privacy.noise_multiplier
    if comm.rank == 0:
        try:
            if is_done(folder):  # done runs are never rewritten, not even their lock file
                _check_existing(folder, cfg)  # ... and answer only for their own config
                outcome = _DONE
            else:
                make_folder(folder)
                lock = RunLock(folder).acquire()
                if is_done(folder):  # finished while we waited for the lock
                    _check_existing(folder, cfg)
                    outcome = _DONE
                else:
                    existed, nonce, stored = _check_existing(folder, cfg)
                    check_checkpoint_path(folder)  # before any file is touched
                    if not existed:  # the first start: this run's identity from now on
                        nonce = cfg.run.nonce or secrets.token_hex(16)
                    if existed and cfg.privacy.noise_multiplier is None and stored is not None:
                        # σ from the target: the one the run began with, not a recount
                        cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(
                            cfg.privacy, noise_multiplier=float(stored)))
                    else:
                        cfg = resolve_sigma(cfg)
                    sigma = cfg.privacy.noise_multiplier
                    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, nonce=nonce))
                    removed = clean_temp_files(folder)  # what a killed writer left half-written
                    write_config(folder, cfg)
                    record_attempt(folder, cfg)
                    if cfg.privacy.secure_mode and comm.world_size > 1:
                        new_job_secret(folder)  # authenticates the ranks' key exchange
        except UserError as exc:
            outcome, error = "error", exc
            if lock is not None:  # ours to record: the folder must not stay "running"
                _fail_status(folder, cfg, str(exc))
        except BaseException:  # a stop signal while taking the folder
            if lock is not None:
                lock.release()
            raise
        if outcome != "run" and lock is not None:
            lock.release()
            lock = None
    shared = outcome if error is None else f"error: {error}"
    if comm.world_size > 1:
        shared, nonce, sigma = comm.broadcast_object((shared, nonce, sigma) if comm.rank == 0
                                                     else None)
    if error is not None:
        raise error
    if shared.startswith("error: "):
        raise UserError(shared[len("error: "):])
    if shared == _DONE:
        if comm.rank == 0:
            print(f"cluster-fl: run already finished: {folder}", file=sys.stderr)
        return True, None, [], None, sigma
    return False, lock, removed, nonce, sigma


def _working_config(cfg: Config, comm: Comm, folder: Path) -> Config:
    """The config the engine runs. Secure mode has no seed: rank 0 draws one from the OS at
    every start (every rank gets it, encrypted under its key with rank 0, which the job secret
    authenticates: never on the wire in plain) for client randomness; it is never written
    anywhere, and the run keeps its folder (``run_id`` pinned to it)."""
    if not cfg.privacy.secure_mode:
        return cfg
    seed = secrets.randbits(63) if comm.rank == 0 else None
    if comm.world_size > 1:
        from cluster_fl.secure_sum import agree_pair_keys, share_from_rank0

        keys = agree_pair_keys(comm, read_job_secret(folder))
        box = share_from_rank0(comm, keys, None if seed is None else seed.to_bytes(8, "little"),
                               "run seed")
        seed = int.from_bytes(box, "little")
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed,
                                                            run_id=folder.name))


def _fail_status(folder: Path, cfg: Config, reason: str) -> None:
    """status.json says ``failed`` with ``reason`` (best effort; a done run is left alone)."""
    status = read_status(folder) or {}
    if status.get("state") == "done":
        return
    try:
        write_status(folder, "failed", int(status.get("round") or 0), cfg.fl.rounds,
                     error=reason)
    except (UserError, OSError):
        pass


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
        elif _private(cfg):  # a message may carry data-dependent values: the operator's only
            reason = f"{type(exc).__name__} (the message is in the operator log)"
            OperatorLog(folder, True, private=True)("failed",
                                                    error=f"{type(exc).__name__}: {exc}")
        else:
            reason = f"{type(exc).__name__}: {exc}"
        write_status(folder, "failed", status.get("round", checkpoint_round), cfg.fl.rounds,
                     error=reason)
        log(f"failed: {reason}", echo=False)  # the CLI prints the one-line error itself
    except (UserError, OSError):
        pass


@dataclass
class _Attempt:
    """This rank's attempt at a run: the built world, the round it starts from, the state and
    the released rows so far, and the operator's side (exact facts, outside the folder)."""

    world: Any  # cluster_fl.engine.setup.World (imported with the run)
    state: dict
    rows: list[dict]
    start_round: int
    oplog: OperatorLog
    skipped: Any  # cluster_fl.engine.metrics.SkippedRows
    t_start: float
    watch: Watch  # the clock, performance and trackers of this attempt
    quiet: int = 0  # rounds in which none of rank 0's lane's clients contributed (operator only)


def _train(cfg: Config, comm: Comm, folder: Path, log: Log, stop: StopFlag,
           progress: dict, record: Config) -> Path:
    run = _resume(cfg, comm, folder, log, progress)
    try:  # the recorded config: a secure run's drawn seed is no part of it
        run.watch.open(cfg.run.report_to, folder, to_dict(record), comm.rank == 0, cfg.fl.rounds,
                       run.start_round)
        stop.set_immediate(False)  # from here a signal stops at the end of the round
        budget = None
        for r in range(run.start_round, cfg.fl.rounds + 1):
            budget = over_budget(run.world.ledger, r, cfg)
            if budget is not None:
                log(budget)
                break
            _round(run, r, cfg, comm, folder, log, stop, progress)
        _finish(run, cfg, comm, folder, log, stop, record, budget)
    finally:
        run.watch.close()
    return folder


def _resume(cfg: Config, comm: Comm, folder: Path, log: Log, progress: dict) -> _Attempt:
    """Build the world and take over what earlier attempts left: what a resume trusts is
    verified before anything is built -- the checkpoint (run id, round, zip CRC, state digest),
    then, once the world is built, the write-ahead ledger."""
    from cluster_fl.engine import setup, startup
    from cluster_fl.engine.metrics import SkippedRows

    main = comm.rank == 0
    oplog = OperatorLog(folder, main, private=_private(cfg))  # exact facts, outside the folder
    ckpt = load_run_checkpoint(folder, rounds=cfg.fl.rounds, nonce=cfg.run.nonce,
                               check_nonce=True)
    setup.set_threads(cfg, comm)
    t_start = time.perf_counter()
    world = setup.build_world(cfg, comm, log)
    skipped = SkippedRows(folder, world.evaluation.store.errors, _owners(world.engine.clients),
                          main, lambda msg: oplog("skipped", message=msg))
    run = _Attempt(world, world.initial_state, [], 1, oplog, skipped, t_start,
                   Watch(world, cfg.fl.rounds))
    world.ledger.attach(folder, main, nonce=cfg.run.nonce,
                        dataset=DatasetLedger(cfg, folder) if _private(cfg) else None)
    for note in start_notes(cfg, world.ledger.ledger):
        log(note)
    world.ledger.resume(ckpt)
    if ckpt is not None:  # checkpoints hold host tensors; the state lives on the model's device
        run.state = {k: v.to(world.placement.device) for k, v in ckpt["state"].items()}
        world.load_state_dicts(ckpt)
        run.rows = [r for r in ckpt["rows"] if r["round"] <= ckpt["round"]]
        run.start_round = ckpt["round"] + 1
        progress["checkpoint_round"] = ckpt["round"]
        log(f"resumed from round {ckpt['round']}")
    if world.ledger.started >= run.start_round:
        oplog("resume", checkpoint_round=run.start_round - 1, rounds_started=world.ledger.started,
              charged=world.ledger.rounds, secure=world.ledger.secure)
    startup.check_start(comm, folder, run.start_round - 1)  # loading over everywhere, folder shared
    if main:
        write_status(folder, "running", run.start_round - 1, cfg.fl.rounds)
        write_json(folder / "groups.json", world.groups_json())
    skipped.collect(comm)
    return run


def _round(run: _Attempt, r: int, cfg: Config, comm: Comm, folder: Path, log: Log,
           stop: StopFlag, progress: dict) -> None:
    """Round ``r``: charge, train, release its row, checkpoint; a stop signal ends the run here
    (:class:`Preempted`) once every rank has the round."""
    from cluster_fl.engine.evaluation import wer_text
    from cluster_fl.engine.metrics import progress_line, write_rows

    world, main, rounds = run.world, comm.rank == 0, cfg.fl.rounds
    world.ledger.charge(r)  # durable BEFORE the round's noise is drawn (write-ahead)
    out = world.engine.run_round(r, run.state)
    run.state = out.state
    out.row["epsilon"] = world.ledger.epsilon()
    evaluated = ""
    if cfg.eval.every and r % cfg.eval.every == 0 and r < rounds:
        with run.watch.evaluating():
            summary, _ = world.evaluate(run.state)  # every rank decodes its slice
        if summary is not None:
            out.row.update({k: v for k, v in summary.items() if k.startswith("wer")})
            evaluated = wer_text(summary)  # readable where diagnostics are not
    run.rows.append(out.row)
    run.watch.round(r, progress_line(r, rounds, out.row, evaluated), out.row, out.operator, log)
    run.oplog("round", round=r, **out.operator)
    facts = out.operator
    if facts.get("trained", 0) - facts.get("nonfinite", 0) < 1:
        run.quiet += 1
        where = "" if facts.get("lanes", 1) == 1 else " on rank 0's lane"
        run.oplog.warn(f"round {r}: no client contributed{where} (cohort {facts.get('cohort')}, "
                       f"{facts.get('nonfinite')} non-finite, {facts.get('skipped')} without "
                       "usable audio); the update was noise only")
    run.skipped.collect(comm)
    stop_now = _agree(comm, stop.set)
    if main:
        write_rows(folder / "rounds.parquet", run.rows)
        if r % cfg.run.checkpoint_every == 0 or r == rounds or stop_now:
            save_run_checkpoint(folder, {"round": r, "run_nonce": cfg.run.nonce,
                                         "state": {k: v.cpu() for k, v in run.state.items()},
                                         **world.state_dicts(), "rows": run.rows})
            progress["checkpoint_round"] = r
        write_status(folder, "running", r, rounds)
        flatten_times(folder)  # no file dates the round (log.txt's line above included)
    comm.barrier(slow=True)  # waits for rank 0's checkpoint write
    if stop_now and r < rounds:
        if main:
            write_status(folder, "preempted", r, rounds)
        log(f"stopped by signal after round {r}; checkpoint saved, resubmit to resume")
        if main:
            flatten_times(folder)
        raise Preempted(folder)


def _finish(run: _Attempt, cfg: Config, comm: Comm, folder: Path, log: Log, stop: StopFlag,
            record: Config, budget: str | None = None) -> None:
    """The final evaluation and the run's last writes (rank 0), then every rank waits.
    ``budget``: why the run stopped before its last round (``privacy.max_epsilon``)."""
    from cluster_fl.engine.metrics import write_rows

    world, main, rounds = run.world, comm.rank == 0, cfg.fl.rounds
    last = run.rows[-1]["round"] if budget is not None and run.rows else rounds
    _check_contributions(run.rows, run.quiet, max(last - run.start_round + 1, 0), run.oplog,
                         world.engine.layout.lanes)
    stop.set_immediate(True)  # the final evaluation: a signal stops it at once
    with run.watch.evaluating():
        summary, eval_rows = world.evaluate(run.state)  # sharded over lanes; rank 0 gets rows
    stop.set_immediate(False)  # the last writes take a moment: let them finish
    run.skipped.collect(comm)
    if main:
        write_rows(folder / "eval.parquet", eval_rows)
        world.ledger.write()  # the final record (the write-ahead one, complete)
        final = world.final_row(summary, time.perf_counter() - run.t_start, git_commit())
        run.oplog("done", wall_s=final.pop("wall_s", None), skipped_utterances=run.skipped.total)
        if record.privacy.secure_mode:  # the drawn seed is no part of the record
            final.update(seed=None, config_json=json.dumps(to_dict(record), sort_keys=True))
        if budget is not None:
            final["rounds"] = last  # the rounds charged, not fl.rounds
        write_rows(folder / "final.parquet", [final])
        write_status(folder, "done", last, rounds,
                     **({"reason": budget} if budget is not None else {}))
        from cluster_fl.engine.evaluation import cut_note  # hypotheses cut by the limit
        log(f"done: WER {final.get('wer', float('nan')):.4f}{cut_note(final)}, "
            f"epsilon {final['epsilon']:.3g} "
            f"[{world.ledger.to_json()['guarantee']}] -> {folder}")
        run.watch.final(last, final, log, run.oplog)  # exact timings: screen and operator log
        flatten_times(folder)
    comm.barrier(slow=True)  # waits for rank 0's scoring and writes


def _check_contributions(rows: list[dict], quiet: int, ran: int, oplog: OperatorLog,
                         lanes: int = 1) -> None:
    """A run in which no client ever contributed learned nothing. Where the rows release the
    diagnostics exactly (a non-private or void run), that is decided on them and the run fails;
    otherwise the released values are noised and the exact counts are the operator's alone: a
    warning in the operator log, and the run ends as it is (deciding on exact counts would make
    the run's outcome an unaccounted release)."""
    exact = [r for r in rows if r.get("diagnostics") == "exact"]
    if rows and len(exact) == len(rows) and all(
            (r.get("n_clients") or 0) - (r.get("n_nonfinite") or 0) < 0.5 for r in rows):
        raise UserError(f"no client contributed in any of the {len(rows)} rounds (every update "
                        "non-finite or without usable audio): the model learned nothing; e.g. "
                        "lower fl.lr or the client.lr_*_mult keys, or check data.corpus")
    if ran and quiet == ran:
        who = "no client" if lanes == 1 else "no client of rank 0's lane"
        oplog.warn(f"{who} contributed in any of the {ran} round(s) of this attempt: the model "
                   "learned nothing; e.g. lower fl.lr or the client.lr_*_mult keys, or check "
                   "data.corpus")


def evaluate_start(cfg: Config) -> tuple[dict, list[dict]]:
    """(summary, rows) of the model a run of ``cfg`` starts from -- round 0, before any client
    trains -- on the run's evaluation set, by the run's own evaluation (one process): the
    baseline federated training is measured against."""
    from cluster_fl.distributed import LocalComm
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


def _agree(comm: Comm, flag: bool) -> bool:
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

