"""The operator log: a run's exact operational facts, kept OUTSIDE its released run folder.

A DP run's folder holds public or noised values only (DESIGN §13). What an operator needs to
watch a run -- per round the realised cohort size, how many of rank 0's lane's clients trained,
had non-finite updates or had no usable audio, the round's wall time and the time of day; every
unusable corpus row with its client and shard; warnings such as a round in which none of those
clients contributed -- are exact statistics of the clients' data, NOT protected by the run's
(ε, δ). Rank 0 writes them to ``<run.out>/<run.experiment>/.operator/<run_id>.log``, one JSON
object per line (``{"time", "event", ...}``), and the unusable rows to ``<run_id>.skipped.json``
beside it. ``table``, ``plot`` and the audit never read these files; ``status`` reads the round times for
the operator's own screen (a running run's ETA); do not publish the ``.operator`` folder with the
results (``.gitignore`` keeps it out of this repository).

Rank 0 sees its own lane's clients only: in a run of several lanes the counts are that lane's
(the other ranks' partial sums reach rank 0 masked and noised, never in the clear).
"""

from __future__ import annotations

import datetime as _dt
import json
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

    def __init__(self, folder: Path | None, enabled: bool):
        self.path = operator_path(folder) if folder is not None and enabled else None

    def __call__(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
                  "event": event, **fields}
        append_text(self.path, json.dumps(record, default=str) + "\n")

    def warn(self, message: str, **fields: Any) -> None:
        """A warning for the operator: on stderr and in the operator log, never in the run's
        log.txt (it is drawn from exact counts)."""
        if self.path is None:
            return
        print(f"cluster-fl: operator warning (unprotected, not in the run folder): {message}",
              file=sys.stderr, flush=True)
        self("warning", message=message, **fields)
