"""The run folder: where a run lives, who writes it, how its files are written, what state it is in.

``<run.out>/<run.experiment>/<run_id>/`` holds config.yaml, status.json, rounds.parquet,
final.parquet, eval.parquet, privacy.json (the privacy ledger, written ahead of every round's
noise), groups.json, provenance.json (the starting model's hash and each attempt's machine),
checkpoint/, log.txt and run.lock; the exact operational facts of a run live
outside it, in ``<run.experiment>/.operator/`` (:mod:`cluster_fl.engine.operator_log`). Every file
is written to a temporary name and renamed, so a crash never leaves a half-written file; the
temporary files a killed writer leaves are removed by the next writer (:func:`clean_temp_files`). A
run whose status is ``done`` is never rewritten.

One writer per folder: rank 0 holds an exclusive ``flock`` on ``run.lock`` for the run's life
(:class:`RunLock`; the file names the holder's host and pid). The kernel drops the lock when the
holder dies, so a killed run's lock is taken over by the next attempt, and a second ``train`` on a
live run stops with one line naming the holder. A failed write (full disk, read-only, not a
folder) is a :class:`WriteError` naming the file: one line and exit 2, never a traceback.

No wall-clock time is kept in the folder: the lock names its holder without a start
time, status.json carries no ``updated`` (the heartbeat the grid's staleness check reads lives
beside the operator log, :func:`heartbeat_path`), and rank 0 sets every file's and folder's
modification time to the epoch at each round's end and at the run's end
(:func:`flatten_times`), so the folder's times cannot date its rounds.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

from cluster_fl.config import Config, dump_config, require_resolved, to_dict
from cluster_fl.errors import UserError

LOCK_NAME = "run.lock"
# temporary names of atomic_write_bytes (``.NAME.tmpPID``) and of older writers (``.tmp-PID``)
_TEMP = re.compile(r"^\..+\.tmp-?\d+$")

# Keys that do not change what a run computes, so they do not enter its id.
# keys that may differ between the submissions of one run (a resume on other hardware)
RESUME_TOLERATED = {("run", "out"), ("run", "threads"), ("run", "timeout_s"),
                    ("run", "wait_timeout_s"), ("run", "device"),
                    ("run", "report_to"),  # where the released values are also sent
                    ("data", "allow_missing_languages"),
                    # where the client features live while training: speed, not results
                    ("data", "device_resident"),
                    # how a lane is laid out changes memory, not results (within float tolerance)
                    ("model", "activation_checkpointing"), ("model", "shard"),
                    ("model", "shard_group_size"),
                    # clients per batched step and rows per pass: speed, not results (within
                    # float tolerance)
                    ("fl", "clients_per_step"), ("fl", "rows_per_pass"),
                    # a compiled step: speed, not results (within float tolerance)
                    ("model", "compile"),
                    # decoding's KV cache: speed, not results (the same tokens, bitwise)
                    ("eval", "decode_cache")}
# keys that do not enter the run id
_BOOKKEEPING = RESUME_TOLERATED | {("run", "experiment"), ("run", "run_id"),
                                   ("run", "checkpoint_every"), ("run", "nonce")}
# files and folders enter the id by their last name only: the same corpus and checkpoint under
# another home or scratch folder is the same run, with the same id and so the same research noise
# (the demo printed another table for every $HOME until 2026-12-05)
_PATH_KEYS = {("data", "corpus"), ("data", "feature_cache"), ("model", "checkpoint"),
              ("model", "encoder_path"), ("model", "decoder_path"), ("model", "tokenizer_path"),
              ("pretrain", "out")}
# keys added after runs existed: left out of the id at their default, so old ids stay valid
_NEW_AT_DEFAULT = {("model", "dtype"): "float32", ("privacy", "grouping"): "matrix",
                   ("pretrain", "mode"): "joint", ("model", "connector_init"): "checkpoint",
                   ("model", "connector_seed"): None,  # null: the run's seed
                   ("privacy", "max_epsilon"): None,
                   ("model", "pad_to_window"): False,  # unpadded: the behaviour before the key
                   ("data", "public_split"): "public",
                   ("model", "init"): "auto"}


def path_names(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` (a config as nested dicts) with its file and folder keys cut to their last name,
    in place: how run ids and resumes compare them."""
    for section, key in _PATH_KEYS:
        if tree.get(section, {}).get(key):
            tree[section][key] = os.path.basename(os.path.normpath(str(tree[section][key])))
    return tree


def run_id(cfg: Config) -> str:
    """Deterministic run id: readable prefix + hash of everything that affects results."""
    if cfg.run.run_id:
        return cfg.run.run_id
    require_resolved(cfg, "run_id")  # data.n_mels 0 would hash apart from the model's value
    tree = to_dict(cfg)
    for section, key in _BOOKKEEPING:
        tree[section].pop(key, None)
    path_names(tree)
    for (section, key), default in _NEW_AT_DEFAULT.items():
        if tree[section].get(key) == default:
            tree[section].pop(key)
    digest = hashlib.sha1(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:8]
    method = "fedavg" if cfg.privacy.mechanism == "none" else cfg.privacy.clipping
    frozen = "frozen" if cfg.model.freeze_encoder else "unfrozen"
    seed = "secure" if cfg.run.seed is None else cfg.run.seed  # secure mode has no seed
    return f"{cfg.model.arch}_{frozen}_{method}_s{seed}_{digest}"


def run_dir(cfg: Config) -> Path:
    """The folder of the run described by ``cfg``."""
    return Path(cfg.run.out).expanduser() / cfg.run.experiment / run_id(cfg)


class WriteError(UserError):
    """A file could not be written (full disk, read-only, a file where a folder should be...)."""

    def __init__(self, path: Path | str, exc: OSError):
        self.path, self.errno = Path(path), exc.errno
        reason = exc.strerror or str(exc)
        super().__init__(f"cannot write {path}: {reason}" + (f" (errno {exc.errno})"
                                                              if exc.errno else ""))


def make_folder(folder: Path, key: str = "run.out") -> None:
    """``mkdir -p`` that fails with one line naming the folder and the config key."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{key}: cannot create folder {folder}: {exc.strerror or exc}") from None


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write ``data`` to ``path`` via a temporary file + fsync + rename. ``durable`` also fsyncs
    the folder, so the rename itself survives a power cut (the write-ahead privacy ledger). On
    failure the temporary file is removed and a :class:`WriteError` names ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        if durable:
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as exc:
        _unlink(tmp)
        raise WriteError(path, exc) from None
    except BaseException:  # a signal raised mid-write: leave no temporary file behind
        _unlink(tmp)
        raise


def append_text(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (logs); a failure is a :class:`WriteError`."""
    try:
        with open(path, "a") as fh:
            fh.write(text)
    except OSError as exc:
        raise WriteError(path, exc) from None


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def clean_temp_files(folder: Path) -> list[Path]:
    """Remove temporary files that killed writers left in the run folder (call holding the
    lock: no other writer can be mid-write). Returns what was removed."""
    removed = []
    for sub in (Path(folder), Path(folder) / "checkpoint", Path(folder) / "channels"):
        if not sub.is_dir():
            continue
        for p in sub.iterdir():
            if _TEMP.match(p.name) and p.is_file():
                _unlink(p)
                removed.append(p)
    return removed


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_json(path: Path, obj: Any, *, durable: bool = False) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False, default=_jsonable) + "\n"
    if durable:
        atomic_write_bytes(Path(path), text.encode(), durable=True)
    else:
        atomic_write_text(path, text)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_status(folder: Path) -> dict[str, Any] | None:
    """The run's status.json; None when the run has not started (no file). The one reader of
    it, for the engine (resume, refuse a finished run) and for the grid (a run's state): a file
    that exists but cannot be read or parsed -- a status overwritten in place on a full disk and
    cut short, a permission or network-filesystem error -- reads as a failed run that says why,
    never as a run that has not started."""
    path = Path(folder) / "status.json"
    if not path.is_file():
        return None
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"state": "failed", "error": f"unreadable status.json ({type(exc).__name__})"}
    if not isinstance(status, dict):
        return {"state": "failed", "error": "unreadable status.json (not an object)"}
    try:  # when it was last written: kept outside the folder, for the grid's staleness check
        beat = json.loads(heartbeat_path(folder).read_text())
        if "updated" not in status and isinstance(beat, dict) and beat.get("updated"):
            status["updated"] = beat["updated"]
    except (OSError, ValueError):
        pass
    return status


def heartbeat_path(folder: Path) -> Path:
    """``<experiment>/.operator/<run_id>.heartbeat``: when rank 0 last wrote the run's status
    (beside the operator log of :mod:`cluster_fl.engine.operator_log`, 0700)."""
    return Path(folder).parent / ".operator" / f"{Path(folder).name}.heartbeat"


def flatten_times(folder: Path) -> None:
    """Set the modification (and access) time of the run folder, and of everything in it, to
    the epoch: file times would otherwise date the run's start, its rounds and its end. Best
    effort (a file another process replaces meanwhile keeps its time until the next call)."""
    root = Path(folder)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            try:
                os.utime(os.path.join(dirpath, name), (0, 0), follow_symlinks=False)
            except OSError:
                pass
    try:
        os.utime(root, (0, 0))
    except OSError:
        pass


def write_status(folder: Path, state: str, round_: int, rounds: int,
                 error: str | None = None, **extra: Any) -> None:
    """status.json, atomically; on a full disk, overwritten in place (its block is allocated
    already), so a run that fails for lack of space can still say so."""
    path = Path(folder) / "status.json"
    payload = {"state": state, "round": round_, "rounds": rounds,
               "host": socket.gethostname(), "pid": os.getpid(), "error": error, **extra}
    try:  # the time outside the folder (module docstring); best effort
        beat = heartbeat_path(folder)
        beat.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        beat.write_text(json.dumps({"updated": _dt.datetime.now(_dt.timezone.utc).isoformat(
            timespec="seconds")}))
        beat.chmod(0o600)
    except OSError:
        pass
    try:
        write_json(path, payload)
    except WriteError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or not path.is_file():
            raise
        data = (json.dumps(payload, indent=2, default=_jsonable) + "\n").encode()
        try:
            with open(path, "r+b") as fh:
                fh.write(data)
                fh.truncate(len(data))
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            raise exc from None


def is_done(folder: Path) -> bool:
    status = read_status(folder)
    return bool(status and status.get("state") == "done")


class RunLocked(UserError):
    """Another live process writes this run folder."""

    def __init__(self, folder: Path, holder: dict[str, Any]):
        self.holder = holder
        who = (f"{holder.get('host', '?')} pid {holder.get('pid', '?')}"
               if holder else "another process")
        super().__init__(f"run folder {folder} is being written by {who}; one writer per run: "
                         "wait for it to end or stop it (a killed writer's lock is taken over)")


class RunLock:
    """Exclusive ``flock`` on ``<folder>/run.lock``, held by rank 0 for the run's life.

    The file keeps the holder's host and pid (no start time: the folder keeps no clock).
    ``flock`` locks belong to the open file and the kernel drops them when the process dies
    (on NFS, when the client's lease ends), so a stale lock never blocks: the next attempt
    takes it over. On a file system without locks (``enforced`` is False), a holder on this
    host is still detected by its pid.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.fd: int | None = None
        self.enforced = True

    def acquire(self) -> "RunLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise WriteError(self.path, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLocked(self.folder, holder) from None
        except OSError:  # ENOLCK / EOPNOTSUPP: the file system has no locks
            holder = _read_holder(fd)
            if _alive_here(holder):
                os.close(fd)
                raise RunLocked(self.folder, holder) from None
            self.enforced = False
        self.fd = fd
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        try:  # overwrite in place: no new block needed, so a full disk does not stop us here
            os.pwrite(fd, info, 0)
            os.ftruncate(fd, len(info))
        except OSError:
            pass  # the lock holds without its label
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _alive_here(holder: dict[str, Any]) -> bool:
    """The holder runs on this host and its process exists (and it is not us)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
