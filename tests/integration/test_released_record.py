"""A DP run's folder releases no exact count derived from the clients' data, and no timing.

A real 3-round DP run (Poisson sampling, so the realised cohort size varies and is private;
noised diagnostics) is read back file by file -- every Parquet table, every JSON and YAML file,
log.txt and the checkpoint's rows -- and held against the exact facts of each round, which the
run wrote to its operator log outside the folder (so the test knows what must not appear):

- no column or key names an exact fact (realised cohort, empty-round flag, skipped rows) or a
  time (wall_s, timestamps), no file lists unusable rows per client;
- no released per-round value equals the round's exact cohort size or contributed count;
- log.txt has no time of day and no duration, and every client count it shows carries its ±;
- the audit's scan of the released record (:mod:`cluster_fl.audit.record`) finds nothing, and
  fires on a copy of the folder with the realised cohort size planted back in its rows.
The operator log does hold those facts, outside the folder: the test is not vacuous.
"""

from __future__ import annotations

import json
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cluster_fl.audit.record import EXACT_FIELDS, TIMING_FIELDS, scan_record
from cluster_fl.config import load_config
from cluster_fl.engine.operator_log import operator_dir, operator_path, read_operator_log
from cluster_fl.engine.train import run_training

TINY = ["model.arch=whisper-tinyllama-tiny", "fl.rounds=3", "fl.clients_per_round=4",
        "fl.sampling=poisson", "fl.max_local_steps=2", "fl.batch_size=4",
        "eval.max_utterances=4", "eval.bootstrap=10", "eval.max_new_tokens=6", "run.threads=1",
        "privacy.noise_multiplier=0.5", "privacy.diagnostics=noised", "run.seed=3"]
PUBLIC_COLUMNS = re.compile(r"^(round|denominator|epsilon|diagnostics|diag_noise_std|"
                            r"threshold/.*)$")


@pytest.fixture(scope="module")
def dp_run(tiny_corpus, tmp_path_factory):
    torch.set_num_threads(1)
    cfg = load_config(None, [f"data.corpus={tiny_corpus}", "data.languages=[en,de,fr]",
                             f"run.out={tmp_path_factory.mktemp('released')}", *TINY])
    folder = run_training(cfg)
    facts = {e["round"]: e for e in read_operator_log(folder) if e["event"] == "round"}
    return folder, facts


def _keys(obj):
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


def test_the_operator_log_holds_the_exact_facts_outside_the_run_folder(dp_run):
    folder, facts = dp_run
    assert sorted(facts) == [1, 2, 3]
    assert len({f["cohort"] for f in facts.values()}) >= 1
    assert all(f["wall_s"] > 0 and f["trained"] <= f["cohort"] for f in facts.values())
    assert operator_path(folder).is_file() and operator_dir(folder).parent == folder.parent
    assert folder not in operator_path(folder).parents


def test_every_released_file_is_free_of_exact_counts_and_times(dp_run):
    folder, facts = dp_run
    seen = set()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = str(path.relative_to(folder))
        seen.add(rel)
        if path.suffix == ".parquet" or path.name == "state.pt":
            rows = (pq.read_table(path).to_pylist() if path.suffix == ".parquet" else
                    torch.load(path, map_location="cpu", weights_only=False)["rows"])
            columns = {k for r in rows for k in r}
            assert not columns & EXACT_FIELDS, (rel, columns & EXACT_FIELDS)
            assert not [c for c in columns if TIMING_FIELDS.search(c)], rel
            for row in rows:
                if "round" not in row or path.name == "eval.parquet":
                    continue
                f = facts[row["round"]]
                exact = {f["cohort"], f["trained"] - f["nonfinite"]}
                leaked = [k for k, v in row.items() if not PUBLIC_COLUMNS.match(k)
                          and isinstance(v, (int, float)) and v in exact]
                assert leaked == [], (rel, row["round"], leaked)
        elif path.suffix == ".json":
            keys = _keys(json.loads(path.read_text()))
            assert not keys & EXACT_FIELDS, (rel, keys & EXACT_FIELDS)
            assert not [k for k in keys if TIMING_FIELDS.search(k)], rel
        elif path.name == "log.txt":
            for line in path.read_text().splitlines():
                assert not re.search(r"\d{1,2}:\d{2}:\d{2}", line), line
                assert not re.search(r"\d+(\.\d+)?s\b", line.split("->")[0]), line
                for m in re.finditer(r"clients (\S+)( ±)?", line):
                    assert m.group(2) or m.group(1) == "±", line
    assert {"rounds.parquet", "final.parquet", "eval.parquet", "privacy.json", "log.txt",
            "status.json", "config.yaml", "groups.json", "checkpoint/state.pt"} <= seen
    assert "skipped.json" not in seen
    found = scan_record(folder)
    assert found == {"exact_counts": [], "timing": []}, found


def test_the_scan_fires_on_the_realised_cohort_planted_back(dp_run, tmp_path):
    folder, facts = dp_run
    copy = tmp_path / folder.parent.name / folder.name
    shutil.copytree(folder, copy)
    shutil.copytree(operator_dir(folder), operator_dir(copy))
    rows = pq.read_table(copy / "rounds.parquet").to_pylist()
    for r in rows:  # a column under an innocent name, holding the exact cohort size
        r["clients_seen"] = facts[r["round"]]["cohort"]
    pq.write_table(pa.Table.from_pylist(rows), copy / "rounds.parquet")
    found = scan_record(copy)
    assert any("clients_seen" in f and "exact cohort" in f for f in found["exact_counts"]), found
