"""The released run record as an observer reads it: does it hold an exact count or a time?

DESIGN §13: a DP run's folder releases public or noised values only. :func:`scan_record` reads
every file of a run folder an observer can read -- rounds.parquet, final.parquet, eval.parquet,
the checkpoint's rows, log.txt, status.json, privacy.json, groups.json, provenance.json,
config.yaml -- and lists
what it finds:

* ``exact_counts``: a column or key naming an exact fact of the clients (:data:`EXACT_FIELDS`:
  the realised cohort, empty-round flags, skipped-row counts), a per-client record of unusable
  rows (``skipped.json``), log lines that name unusable rows or show a client count without its
  noise, and -- with the run's operator log at hand, which has the exact facts of every round --
  any released per-round value equal, in every round, to the realised cohort size or the number
  of clients that contributed;
* ``timing``: a wall-time or timestamp column, a time of day or a duration in log.txt.

status.json keeps the time of its last update (the grid's liveness check, DESIGN §8): an
operational field, the only time in the folder, documented as such and not reported. Exact
diagnostics (``privacy.diagnostics: exact``, a void run) are reported like any other exact count:
the run says its guarantee is void, and the audit says why.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

EXACT_FIELDS = {"n_cohort", "empty", "empty_rounds", "skipped_utterances", "skipped",
                "per_client", "cohort", "contributed", "n_contributed"}
TIMING_FIELDS = re.compile(r"(^|/)(wall_s|wall|time|timestamp|started|finished|duration_s)$")
# columns that are public by construction (config, accounting, the evaluation of public data)
PUBLIC = re.compile(r"^(round|rounds|denominator|epsilon|delta|diagnostics|diag_noise_std|"
                    r"threshold/.*|sigma/.*|wer.*|cer.*|population|noise_multiplier|clip_norm|"
                    r"alpha|seed|git_commit|config_json|run_id|experiment|arch|method|"
                    r"freeze_encoder|guarantee)$")
RECORD_FILES = ("rounds.parquet", "final.parquet", "eval.parquet", "log.txt", "status.json",
                "privacy.json", "groups.json", "provenance.json", "skipped.json", "checkpoint",
                "run.lock", "start.token")
# "reason": why a run ended before fl.rounds (privacy.max_epsilon), a function of the config
STATUS_KEYS = {"state", "round", "rounds", "updated", "host", "pid", "error", "reason"}
_CLOCK = re.compile(r"\b\d{1,2}:\d{2}:\d{2}\b")
_DURATION = re.compile(r"(?<![\w.])\d+(\.\d+)?\s?s\b")
_CLIENTS = re.compile(r"\bclients (\d+)(?![\d.\s]*±)")  # a count shown without its ±


def _rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist() if path.is_file() else []


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def _operator_facts(run_dir: Path) -> dict[int, dict[str, Any]]:
    from cluster_fl.engine.operator_log import read_operator_log

    return {int(e["round"]): e for e in read_operator_log(run_dir) if e.get("event") == "round"}


def scan_record(run_dir: str | Path, rows: list[dict[str, Any]] | None = None,
                log_lines: list[str] | None = None) -> dict[str, list[str]]:
    """Findings per kind (``exact_counts``, ``timing``) in the released files of ``run_dir``.
    ``rows`` / ``log_lines`` replace rounds.parquet / log.txt (the audit's planted controls)."""
    run_dir = Path(run_dir)
    found: dict[str, list[str]] = {"exact_counts": [], "timing": []}
    tables = {"rounds.parquet": rows if rows is not None else _rows(run_dir / "rounds.parquet"),
              "final.parquet": _rows(run_dir / "final.parquet"),
              "eval.parquet": _rows(run_dir / "eval.parquet")}
    ckpt = run_dir / "checkpoint" / "state.pt"
    if ckpt.is_file():
        try:
            import torch

            tables["checkpoint rows"] = list(torch.load(ckpt, map_location="cpu",
                                                        weights_only=True).get("rows", []))
        except Exception:  # noqa: BLE001 - a damaged checkpoint is the resume's to refuse
            pass
    for name, table in tables.items():
        for col in _columns(table):
            if col in EXACT_FIELDS:
                found["exact_counts"].append(f"{name}: column {col!r}")
            if TIMING_FIELDS.search(col):
                found["timing"].append(f"{name}: column {col!r}")
    if (run_dir / "skipped.json").is_file():
        found["exact_counts"].append("skipped.json: unusable rows per client")
    for name in ("privacy.json", "groups.json", "provenance.json", "run.lock", "start.token"):
        path = run_dir / name
        if path.is_file():
            try:  # start.token is a bare token, not JSON; run.lock names its holder
                keys = _keys(json.loads(path.read_text() or "{}"))
            except ValueError:
                keys = set()
            if name == "run.lock" and "since" in keys:  # older versions: the attempt's start
                found["timing"].append("run.lock: key 'since'")
            found["exact_counts"] += [f"{name}: key {k!r}" for k in sorted(keys & EXACT_FIELDS)]
            found["timing"] += [f"{name}: key {k!r}" for k in sorted(keys)
                                if TIMING_FIELDS.search(k)]
    status = run_dir / "status.json"
    if status.is_file():
        if "updated" in json.loads(status.read_text()):
            found["timing"].append("status.json: key 'updated' (a time of day)")
        extra = set(json.loads(status.read_text())) - STATUS_KEYS
        found["exact_counts"] += [f"status.json: key {k!r}" for k in sorted(extra)]
    lines = log_lines if log_lines is not None else (
        (run_dir / "log.txt").read_text().splitlines() if (run_dir / "log.txt").is_file() else [])
    facts = _operator_facts(run_dir)
    for i, line in enumerate(lines, 1):
        if _CLOCK.search(line):
            found["timing"].append(f"log.txt:{i}: a time of day")
        if line.startswith("round ") and _DURATION.search(line):
            found["timing"].append(f"log.txt:{i}: a round's duration")
        if "unusable corpus row" in line:
            found["exact_counts"].append(f"log.txt:{i}: names an unusable row and its client")
        if line.startswith("round ") and _CLIENTS.search(line) \
                and not _exact_run(tables["rounds.parquet"]):
            found["exact_counts"].append(f"log.txt:{i}: a client count without its noise")
    found["exact_counts"] += _equal_to_facts(tables["rounds.parquet"], facts)
    return found


def _exact_run(rows: list[dict[str, Any]]) -> bool:
    """Rows of a run that releases its diagnostics exactly (void or non-private)."""
    return bool(rows) and all(r.get("diagnostics") == "exact" for r in rows)


def _keys(obj: Any) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


def _equal_to_facts(rows: list[dict[str, Any]], facts: dict[int, dict[str, Any]]) -> list[str]:
    """Released per-round values equal, in every round, to the round's exact cohort size or
    contributed count (from the operator log). A noised value never is, a copied count always."""
    rounds = [r for r in rows if r.get("round") in facts]
    if not rounds:
        return []
    out = []
    for col in _columns(rounds):
        if PUBLIC.match(col):
            continue
        for fact in ("cohort", "contributed"):
            exact = []
            for r in rounds:
                f = facts[r["round"]]
                exact.append(f.get("cohort") if fact == "cohort"
                             else f.get("trained", 0) - f.get("nonfinite", 0))
            values = [r.get(col) for r in rounds]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                   and v == e for v, e in zip(values, exact)):
                out.append(f"rounds.parquet: column {col!r} equals the exact {fact} every round")
    return out
