"""What a researcher sees of a grid: ``grid --wait`` reports progress while it waits and ends
with a summary (each run's state, WER and ε); ``status`` shows a running run's round r/R, ETA
and ε so far and a done run's WER; job logs are at a path the registry names, with no folder
literally called ``%j``."""

from __future__ import annotations

import json
import re

from cluster_fl.cli import main
from cluster_fl.commands import grid as grid_cmd
from cluster_fl.engine.metrics import write_rows
from cluster_fl.engine.operator_log import operator_path
from cluster_fl.sweep import status
from cluster_fl.sweep.gridspec import load_grid
from fakes import fake_train, fake_wer, write_status
from test_grid import grid_args, tiny_grid

from cluster_fl.config import load_config


def test_grid_wait_reports_progress_and_ends_with_a_summary_and_logs_have_a_readable_path(
        tmp_path, capsys):
    path = tiny_grid(tmp_path, methods=("flat",), seeds=(0, 1))
    assert grid_cmd.run(grid_args(path, cluster="local"), train_fn=fake_train) == 0
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("grid t: ")]
    assert progress and re.match(r"grid t: 2/2 runs finished \(2 done\), elapsed \d+:\d\d$",
                                 progress[-1]), captured.err
    out = captured.out.splitlines()
    summary = out[out.index("summary:"):]
    wer = fake_wer(load_config(None, ["privacy.clipping=flat", "run.seed=0"]))
    assert any(line.startswith(f"done     flat__s0: WER {wer:.4f}, eps ") for line in summary)
    grid = load_grid(path)
    assert not list(grid.root.rglob("%j"))
    for run_id, record in status.read_registry(grid).items():
        log = status.job_log(grid, record)
        assert log is not None and log.parent == grid.root / ".grid" / "logs", (run_id, record)
        named = grid.root / ".grid" / "logs" / f"{run_id}.err"  # found by the run's name
        assert named.is_symlink() and named.resolve() == log.resolve()


def test_status_shows_round_eta_and_epsilon_of_a_running_run_and_the_wer_of_a_done_one(
        tmp_path, capsys, monkeypatch):
    path = tiny_grid(tmp_path, methods=("flat",), seeds=(0, 1))
    grid = load_grid(path)
    running, done = grid.root / "flat__s0", grid.root / "flat__s1"
    write_status(running, "running", 2, 8)
    write_rows(running / "rounds.parquet", [{"round": 1, "epsilon": 3.5}, {"round": 2, "epsilon": 5.25}])
    log = operator_path(running)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(json.dumps({"event": "round", "round": r, "wall_s": w}) + "\n"
                           for r, w in ((1, 20.0), (2, 40.0))))
    write_status(done, "done", 8, 8)
    write_rows(done / "final.parquet", [{"wer": 0.65834, "epsilon": 12.0}])
    monkeypatch.setattr(status, "jobs_alive", lambda recs: {r: True for r in recs})
    assert main(["status", str(path)]) == 0
    out = capsys.readouterr().out
    assert "running  flat__s0: round 2/8, ETA 3:00, eps 5.25" in out  # 6 rounds x mean 30 s
    assert "done     flat__s1: WER 0.6583, eps 12" in out
    assert main(["status", str(path), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["round"] == 2 and rows[0]["eta_s"] == 180.0 and rows[0]["epsilon"] == 5.25
    assert rows[1]["wer"] == 0.65834
