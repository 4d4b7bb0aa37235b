"""Per-round metric rows, the Parquet files of a run folder, the per-round log line, and the
record of skipped rows.

``rounds.parquet`` is rewritten atomically after every round (it is small), so a crash never
loses a finished round; on resume the rows after the checkpointed round are dropped. A row and
its log line hold public or noised values only: no realised cohort size, no exact count of
clients, no wall time (those go to the operator log, :mod:`cluster_fl.engine.operator_log`).
The skipped-rows record counts, per client (and for the evaluation set), the corpus rows that
could not be used (undecodable audio, no features), with each row's id, shard and reason: exact
facts about clients' data, so it lives beside the operator log
(``.operator/<run_id>.skipped.json``), not in the run folder; a resumed run merges into it by
utterance id, so a row is counted once however often its shard is read.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from cluster_fl.distributed import Comm
from cluster_fl.engine.operator_log import operator_path
from cluster_fl.engine.rundir import atomic_write_bytes, write_json
from cluster_fl.privacy.diagnostics import LOSS_SCALE

SKIPPED_SUFFIX = ".skipped.json"  # beside the operator log: <experiment>/.operator/<run_id>...


def write_rows(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Write dict rows as one Parquet table (columns = union of keys, missing → null)."""
    rows = [dict(r) for r in rows]
    columns: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns.append(k)
    table = pa.table({c: [_clean(r.get(c)) for r in rows] for c in columns}) if rows else pa.table({})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


def _clean(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def progress_line(r: int, rounds: int, row: Mapping[str, Any], evaluated: str = "") -> str:
    """The log line of round ``r``, built from the released row only: ``round r/R:``, the test
    WER when the round was evaluated (``evaluated``, from
    :func:`cluster_fl.engine.evaluation.wer_text`), ε so far, then the diagnostics. Exact ones (a
    void or non-private run) are shown as they are. Noised ones are estimates with a known noise
    std (``diag_noise_std`` per mean; times the public ``denominator`` for a count): a figure is
    shown clamped to its range with its ±, or, when the ± spans half its range or more, only
    named as too noisy to show at this cohort size; the client count is the noised
    ``n_clients``. With ``privacy.diagnostics: off`` there are none, and no count is shown.
    No wall time: a round's duration is an exact side channel (the engine adds elapsed time and
    ETA on the screen only; the operator log keeps the round's wall time)."""
    eps = row.get("epsilon")
    eps_s = "inf" if eps is None or not math.isfinite(eps) else f"{eps:.3g}"
    head = f"round {r}/{rounds}: " + (f"{evaluated}, " if evaluated else "")
    tail = f"eps {eps_s}"
    mode = row.get("diagnostics")
    denom = float(row.get("denominator") or 0.0)
    if mode == "off":
        return f"{head}{tail} (diagnostics off)"
    if mode != "noised":
        return (f"{head}loss {row.get('loss', float('nan')):.3f}, "
                f"clients {_count(row.get('n_clients'))}, clip rate "
                f"{row.get('clip_rate', 0):.2f}, {tail}")
    std = float(row.get("diag_noise_std") or 0.0)
    shown, hidden = [], []
    for name, value, noise, top in (("loss", row.get("loss"), std * LOSS_SCALE, LOSS_SCALE),
                                    ("clients", row.get("n_clients"), std * denom, denom),
                                    ("clip rate", row.get("clip_rate"), std, 1.0)):
        if value is None or not math.isfinite(value) or noise >= top / 2:
            hidden.append(name)
        elif name == "clients":
            shown.append(f"clients {max(value, 0.0):.0f} ± {noise:.2g}")
        else:
            shown.append(f"{name} {min(max(value, 0.0), top):.2f} ± {noise:.2f}")
    line = head + ", ".join([tail] + shown)
    if shown:
        line += " (noised diagnostics)"
    if hidden:
        line += f" (noised {', '.join(hidden)}: too noisy to show)"
    return line


def _count(value: Any) -> str:
    return "?" if value is None else f"{float(value):.0f}"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a Parquet file written by :func:`write_rows` (empty when missing)."""
    path = Path(path)
    if not path.is_file():
        return []
    return pq.read_table(path).to_pylist()


class SkippedRows:
    """The run's unusable corpus rows, gathered from every rank, written by rank 0 beside the
    operator log (exact per-client counts: unprotected, never in the run folder).

    ``errors`` is the feature store's list of ``{utterance_id, shard, reason}`` (it grows while
    clients train and the evaluation loads its shards); ``owner`` maps an utterance id to the
    client id that holds it (evaluation rows count under ``"eval"``); ``log`` is the operator
    log's line writer.
    """

    def __init__(self, folder: Path, errors: list[dict], owner: Mapping[str, str], main: bool,
                 log: Callable[[str], None]):
        self.path = operator_path(folder, SKIPPED_SUFFIX)
        self.errors, self.owner, self.main, self.log = errors, dict(owner), main, log
        self.seen = 0  # entries of ``errors`` already handed on
        self.rows: dict[str, dict] = {}
        if main and self.path.is_file():
            try:
                self.rows = {r["utterance_id"]: r for r in json.loads(self.path.read_text())["rows"]}
            except (ValueError, KeyError, TypeError):
                self.rows = {}  # rebuilt from this attempt's reads

    def collect(self, comm: Comm) -> None:
        """Collective: every rank hands over its new entries; rank 0 logs and writes them."""
        new = [dict(e) for e in self.errors[self.seen:]]
        self.seen = len(self.errors)
        parts = comm.all_gather_object(new) if comm.world_size > 1 else [new]
        if not self.main:
            return
        fresh = []
        for e in (e for part in parts for e in part):
            uid = str(e.get("utterance_id"))
            if uid not in self.rows:
                client = self.owner.get(uid) or e.get("client", "eval")  # the store tags it
                self.rows[uid] = {"utterance_id": uid, "client": client,
                                  "shard": e.get("shard"),
                                  "reason": e.get("reason", e.get("error", "unreadable"))}
                fresh.append(self.rows[uid])
        for r in fresh[:20]:
            self.log(f"skipped unusable corpus row {r['utterance_id']} (client {r['client']}, "
                     f"{r['shard']}): {r['reason']}")
        if len(fresh) > 20:
            self.log(f"... and {len(fresh) - 20} more unusable rows (see {self.path.name})")
        if fresh:
            write_json(self.path, self.summary())
            self.path.chmod(0o600)  # the operator's alone, like the log beside it

    @property
    def total(self) -> int:
        return len(self.rows)

    def summary(self) -> dict[str, Any]:
        per_client: dict[str, int] = {}
        for r in self.rows.values():
            per_client[r["client"]] = per_client.get(r["client"], 0) + 1
        return {"skipped": self.total, "per_client": dict(sorted(per_client.items())),
                "rows": sorted(self.rows.values(), key=lambda r: r["utterance_id"])}
