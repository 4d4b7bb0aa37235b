"""``grid --round0``: the starting model's score once per arch x condition x seed, cached, in the
same table cell as the runs of its regime (the demo's round-0 row is the same code)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster_fl.engine.metrics import read_rows, write_rows
from cluster_fl.sweep.gridspec import load_grid
from cluster_fl.report.results import NO_CLIENT_DATA, find_runs
from cluster_fl.report.round0 import score_round0
from cluster_fl.report.table import summarise, to_markdown
from resolved import resolved_config  # noqa: E402  (tests stand at a run's entrance)

REPO = Path(__file__).resolve().parents[2]


def _grid(tmp_path: Path, corpus: Path) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(f"""
experiment: r0
out: {tmp_path / 'results'}
set:
  data.corpus: {corpus}
  data.languages: [en, de, fr]
  eval.max_utterances: 6
  eval.bootstrap: 20
  eval.max_new_tokens: 4
  run.threads: 1
axes:
  arch:
    - {{name: whisper-tinyllama-tiny, preset: {REPO}/configs/arch/whisper-tinyllama-tiny.yaml}}
  condition:
    - {{name: heavy, set: {{client.lr_encoder_mult: 0.1}}}}
    - {{name: mild, set: {{client.lr_encoder_mult: 1.0}}}}
  method:
    - {{name: fedavg, preset: {REPO}/configs/method/fedavg.yaml}}
    - {{name: flat, preset: {REPO}/configs/method/flat.yaml}}
seeds: [0, 1]
""")
    return path


def test_one_score_per_regime_and_seed_cached_and_in_its_cell(tmp_path, tiny_corpus):
    grid = load_grid(_grid(tmp_path, tiny_corpus))
    said: list[str] = []
    folders = score_round0(grid, say=said.append)
    assert len(folders) == 4 and len(set(folders)) == 4  # 2 regimes x 2 seeds, not x 2 methods
    runs = find_runs([tmp_path / "results"])
    assert sorted((r.method, r.condition, r.seed) for r in runs) == [
        ("round-0", "unfrozen", 0), ("round-0", "unfrozen", 1),
        ("round-0", "unfrozen enc-lr×0.1", 0), ("round-0", "unfrozen enc-lr×0.1", 1)]
    assert all(r.final["rounds"] == 0 and r.final["epsilon"] == 0.0 for r in runs)
    assert not any("cached" in s for s in said)
    # its privacy row: ε 0 because no client's data was used -- not "none" (no mechanism, ε = ∞)
    assert {r.guarantee for r in runs} == {NO_CLIENT_DATA}
    privacy = to_markdown(summarise(runs, resamples=50)).split("Privacy:")[1]
    rows = [line for line in privacy.splitlines() if "| round-0 |" in line]
    assert len(rows) == 2 and all("| 0.000 | 1e-05 | no client data |" in r for r in rows)
    assert "no client data: round-0, ε = 0" in privacy

    said.clear()
    stamps = [(f / "final.parquet").stat().st_mtime_ns for f in folders]
    assert score_round0(grid, say=said.append) == folders
    assert sum("(cached)" in s for s in said) == 4
    assert stamps == [(f / "final.parquet").stat().st_mtime_ns for f in folders]

    # a folder written before the row carried its config is scored again, so it finds its cell
    row = read_rows(folders[0] / "final.parquet")[0]
    row.pop("config_json")
    write_rows(folders[0] / "final.parquet", [row])
    said.clear()
    score_round0(grid, say=said.append)
    assert sum("(cached)" in s for s in said) == 3
    assert read_rows(folders[0] / "final.parquet")[0]["config_json"]


def test_the_flag_scores_before_submitting(tmp_path, tiny_corpus, monkeypatch):
    from cluster_fl.commands import grid as grid_cmd

    order: list[str] = []
    monkeypatch.setattr(grid_cmd, "score_round0", lambda grid, extra: order.append("round0"))
    monkeypatch.setattr(grid_cmd, "submit", lambda *a, **k: (order.append("submit"), ([], []))[1])
    args = argparse.Namespace(grid=str(_grid(tmp_path, tiny_corpus)), cluster="local",
                              dry_run=False, wait=False, out=None, overrides=[], round0=True)
    assert grid_cmd.run(args) == 0
    assert order == ["round0", "submit"]


def test_round0_scores_one_starting_model_per_seed(tmp_path, tiny_corpus):
    """With a fresh connector, each seed's run -- and so its round-0 -- starts from its own
    connector; methods of one seed share it (the pairs of a paired test start together)."""
    import torch

    from cluster_fl.config import ModelConfig
    from cluster_fl.distributed import LocalComm
    from cluster_fl.engine.setup import build_world
    from cluster_fl.models import build_base, save_checkpoint

    torch.manual_seed(0)
    base = build_base(ModelConfig())
    save_checkpoint(base, base.tokenizer, tmp_path / "pre")

    def start(seed: int, method: str) -> dict[str, torch.Tensor]:
        cfg = resolved_config(None, [f"data.corpus={tiny_corpus}", "data.languages=[en, de, fr]",
                                 f"model.checkpoint={tmp_path / 'pre'}",
                                 "model.connector_init=fresh", f"run.seed={seed}",
                                 f"privacy.clipping={method}", "run.threads=1",
                                 f"run.out={tmp_path / 'runs'}"])
        world = build_world(cfg, LocalComm(), lambda msg: None)
        return {k: v.clone() for k, v in world.initial_state.items() if k.startswith("connector")}

    flat0, split0, flat1 = start(0, "flat"), start(0, "alpha-split"), start(1, "flat")
    assert flat0 and all(torch.equal(flat0[k], split0[k]) for k in flat0)
    assert not all(torch.equal(flat0[k], flat1[k]) for k in flat0)


def test_a_cached_score_of_other_bytes_under_the_same_checkpoint_is_redone(tmp_path, monkeypatch):
    """provenance.json: round-0 is cached by its folder, whose name knows the checkpoint's folder
    name only; a starting model rebuilt under that name (another CPU) is scored again."""
    import json

    import cluster_fl.engine.train as train
    from cluster_fl.config import build_config, override
    from cluster_fl.report.round0 import evaluate_round0

    calls: list[int] = []

    def fake_start(cfg):
        calls.append(1)
        return {"wer": 0.5 + len(calls)}, [{"utt": "a", "errors": 1, "words": 2}]

    monkeypatch.setattr(train, "evaluate_start", fake_start)
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "model.pt").write_bytes(b"first build")
    cfg = override(build_config({}), {"model.checkpoint": str(checkpoint),
                                      "run.out": str(tmp_path / "results"),
                                      "run.experiment": "r0"})
    folder = evaluate_round0(cfg, say=lambda s: None)
    assert evaluate_round0(cfg, say=lambda s: None) == folder and len(calls) == 1  # cached
    (checkpoint / "model.pt").write_bytes(b"rebuilt on another CPU")
    evaluate_round0(cfg, say=lambda s: None)
    assert len(calls) == 2 and read_rows(folder / "final.parquet")[0]["wer"] == 2.5
    record = json.loads((folder / "provenance.json").read_text())
    assert len(record["attempts"]) == 1  # the new score's, not appended to the old one's
