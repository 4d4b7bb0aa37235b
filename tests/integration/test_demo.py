"""``cluster-fl demo`` end to end, reduced: 2 languages, 3 private speakers each, 3 pretraining steps,
2 federated rounds per method, a handful of evaluated utterances.

Runs the real command in a subprocess (corpus rendering → pretraining → four ``run_training`` runs
→ tables) with its cache and results in a temporary folder, and checks the exit code, the printed
table (the starting model's round-0 column, then one column per method, the privacy table with
ε), the paired comparison against flat and the run folders. About a minute on
two cores; a second invocation with the same cache must reuse the finished runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


METHODS = ("flat", "alpha-split", "uniform")  # the demo's default: the heavy regime's finding
REDUCED = ["--languages", "en,de", "--speakers-per-language", "3", "--pretrain-steps", "3",
           "fl.rounds=2", "fl.clients_per_round=4", "fl.max_local_steps=2", "fl.batch_size=8",
           "eval.max_utterances=4", "eval.bootstrap=10", "eval.max_new_tokens=6",
           "pretrain.eval_utterances=4", "pretrain.batch_size=4",  # held-out: the demo caps it
           "eval.every=1",  # the mid-run test WER line (the demo's own config: every 3 rounds)
           "run.threads=1", "--ranks", "2"]  # each run as 2 local processes (torchrun), as on 2+ cores


def _demo(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "cluster_fl", "demo", "--cache", str(tmp / "cache"),
                           "--out", str(tmp / "results"), *REDUCED, *extra],
                          capture_output=True, text=True, env=env, timeout=400)


def test_the_reduced_demo_runs_end_to_end_and_prints_every_method(tmp_path):
    proc = _demo(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    header = next((line for line in out.splitlines() if line.startswith("| arch")), "")
    for m in ("round-0",) + METHODS:
        assert m in header, (m, out)
    assert header.split("|")[3].strip() == "round-0"  # the starting model comes first
    # the privacy table: one row per run, each method's ε the one its run folder recorded, finite,
    # positive and the same for every method (one noise multiplier, one cohort, one round count),
    # at the configured δ; the starting model (no training) spent nothing
    privacy = out[out.index("| arch | condition | method | ε | δ | guarantee"):].split("\n\n")[0]
    eps = {line.split("|")[3].split()[0]: [x.strip() for x in line.split("|")[4:7]]
           for line in privacy.splitlines()[2:]}
    assert set(eps) == {"round-0", *METHODS}, privacy
    assert eps["round-0"] == ["0.000", "1e-05", "no client data"], privacy
    import pyarrow.parquet as pq
    recorded = {}
    for folder in (tmp_path / "results" / "demo").glob("*/final.parquet"):
        method = next((m for m in METHODS if f"_{m}_" in folder.parent.name), None)
        if method is not None:
            recorded[method] = float(pq.read_table(folder).column("epsilon")[0].as_py())
    assert set(recorded) == set(METHODS), recorded
    for m in METHODS:
        assert 0 < recorded[m] < float("inf"), recorded
        assert eps[m] == [f"{recorded[m]:.3f}", "1e-05", "simulation"], (m, privacy)
    assert len(set(recorded.values())) == 1, recorded
    assert proc.stderr.count(", 2 ranks)") == len(METHODS), proc.stderr[-3000:]
    # a line a reader can follow: each run's test WER after round 1 (eval.every)
    assert proc.stderr.count("round 1/2: test WER ") == len(METHODS), proc.stderr[-3000:]
    # then each method paired against flat, over the evaluation's speakers
    paired = out[out.index("Paired against"):]
    for m in ("round-0", "alpha-split", "uniform"):
        assert any(line.split("|")[3].strip().startswith(m) and line.split("|")[4].strip() == "flat"
                   for line in paired.splitlines() if line.startswith("| whisper")), (m, paired)
    runs = sorted(p.parent.name for p in (tmp_path / "results" / "demo").glob("*/final.parquet"))
    assert len(runs) == len(METHODS) + 1, runs
    for m in ("round-0",) + METHODS:
        assert any(f"_{m}_" in r for r in runs), (m, runs)
    # round 0 is scored on the same evaluation set as every method
    utterances = {r: sorted(pq.read_table(tmp_path / "results" / "demo" / r / "eval.parquet")
                            .column("utt_id").to_pylist()) for r in runs}
    assert len({tuple(u) for u in utterances.values()}) == 1 and utterances[runs[0]], utterances
    # cached: the second call reuses the corpus, the checkpoint and the finished runs
    again = _demo(tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    pretrained = next(line for line in again.stderr.splitlines() if "pretrained:" in line)
    assert pretrained.endswith("(cached)"), pretrained  # the checkpoint was reused
    assert again.stderr.count("rounds (cached)") == len(METHODS)
    assert "round 0 (the starting model" in again.stderr and "(cached)" in again.stderr
