"""The operator log: a run's exact operational facts, kept OUTSIDE its released run folder.

A DP run's folder holds public or noised values only (DESIGN §13). What an operator needs to
watch a run -- per round the realised cohort size, how many of rank 0's lane's clients trained,
had non-finite updates or had no usable audio, the round's wall time and the time of day; every
unusable corpus row with its client and shard; warnings such as a round in which none of those
clients contributed -- are exact statistics of the clients' data, NOT protected by the run's
(ε, δ). Rank 0 writes them to ``<run.out>/<run.experiment>/.operator/<run_id>.log``, one JSON
object per line (``{"time", "event", ...}``), and the unusable rows to ``<run_id>.skipped.json``
beside it. ``table``, ``plot`` and the audit never read these files; ``status`` reads the round
times for the operator's own screen (a running run's ETA); do not publish the ``.operator``
folder with the results (``.gitignore`` keeps it out of this repository). The
folder is made 0700 and the log 0600: the operator's alone, not every user's of the machine. In
a private run a warning reaches stderr (which a scheduler keeps in its job logs) only as a
pointer to this log, never with its counts.

Rank 0 sees its own lane's clients only: in a run of several lanes the counts are that lane's
(the other ranks' partial sums reach rank 0 masked and noised, never in the clear).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Any

from cluster_fl.engine.rundir import append_text

OPERATOR_DIR = ".operator"


def operator_dir(folder: Path) -> Path:
    """The operator folder of the run folder ``folder``: a sibling of the run folders."""
    return Path(folder).parent / OPERATOR_DIR


def operator_path(folder: Path, suffix: str = ".log") -> Path:
    """``<experiment>/.operator/<run_id><suffix>`` for the run folder ``folder``."""
    return operator_dir(folder) / f"{Path(folder).name}{suffix}"


def private_folder(path: Path) -> Path:
    """``mkdir -p`` of an operator folder, readable by its owner only (0700, also when it
    existed with a wider mode)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def private_append(path: Path, text: str) -> None:
    """Append ``text`` to ``path``, a file its owner only can read (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def job_secret_path(folder: Path) -> Path:
    """``<experiment>/.operator/<run_id>.secret``: the secret of the job now running ``folder``."""
    return operator_path(folder, ".secret")


def new_job_secret(folder: Path) -> bytes:
    """Rank 0, holding the run's lock, at every start: 32 fresh bytes from the OS in a 0600
    file of the 0700 operator folder -- readable by this job's processes (the run folder's file
    system is shared by every rank, ``engine/startup.py`` checks it), not by other users. They
    authenticate the ranks' key exchange (``secure_sum.agree_pair_keys``)."""
    import secrets

    secret = secrets.token_bytes(32)
    path = job_secret_path(folder)
    private_folder(path.parent)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return secret


def read_job_secret(folder: Path) -> bytes:
    """The secret :func:`new_job_secret` wrote for the job now running ``folder``; a one-line
    :class:`~cluster_fl.errors.UserError` when this rank cannot read it."""
    from cluster_fl.errors import UserError

    path = job_secret_path(folder)
    try:
        secret = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read the job secret {path} ({exc.strerror or exc}): every rank "
                        "must see the run folder's file system") from None
    if len(secret) != 32:
        raise UserError(f"the job secret {path} is damaged ({len(secret)} bytes, not 32)")
    return secret


def read_operator_log(folder: Path) -> list[dict[str, Any]]:
    """The events of a run's operator log, oldest first (empty when there is none)."""
    path = operator_path(folder)
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:  # a line a killed writer left half-written
            continue
    return events


class OperatorLog:
    """Rank 0's writer of the operator log (a no-op elsewhere). Every event is one JSON line;
    :meth:`warn` also prints the message on stderr (the operator's terminal, not the folder)."""

    def __init__(self, folder: Path | None, enabled: bool, private: bool = False):
        self.path = operator_path(folder) if folder is not None and enabled else None
        self.private = private  # a DP run: stderr gets no exact facts
        if self.path is not None:  # before anything (skipped rows too) is written into it
            private_folder(self.path.parent)

    def __call__(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        private_folder(self.path.parent)
        record = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
                  "event": event, **fields}
        try:
            private_append(self.path, json.dumps(record, default=str) + "\n")
        except OSError:
            append_text(self.path, "")  # the one-line WriteError naming the file

    def warn(self, message: str, **fields: Any) -> None:
        """A warning for the operator: in the operator log, never in the run's log.txt (it is
        drawn from exact counts); on stderr too outside private runs, and in a private run only
        as a pointer to the log."""
        if self.path is None:
            return
        shown = (f"see {self.path} (exact counts, outside the run folder)" if self.private
                 else message)
        print(f"cluster-fl: operator warning (unprotected, not in the run folder): {shown}",
              file=sys.stderr, flush=True)
        self("warning", message=message, **fields)
