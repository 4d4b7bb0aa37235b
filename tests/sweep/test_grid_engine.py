"""The tiny grid with the real engine (slow: trains real tiny models). It renders its own small
corpus (the session's ``tiny_corpus``) and starts from a fresh tiny model, so it needs no cache at
the default path (``cluster-fl demo``) and runs in CI."""

import argparse
from pathlib import Path

import pytest

from cluster_fl.cli import main
from cluster_fl.commands import grid as grid_cmd

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_grid_2_cells_x_2_seeds_with_the_engine_and_table_prints_all_4_runs(tmp_path, capsys,
                                                                                tiny_corpus):
    path = tmp_path / "grid.yaml"
    path.write_text((REPO / "configs/grids/tiny.yaml").read_text()
                    .replace("../arch/", str(REPO / "configs/arch") + "/")
                    .replace("../method/", str(REPO / "configs/method") + "/")
                    .replace("    - {name: fedavg", "    # - {name: fedavg")
                    .replace("    - {name: size,", "    # - {name: size,"))
    args = argparse.Namespace(grid=str(path), cluster="local", dry_run=False, wait=True,
                              out=str(tmp_path / "results"),
                              overrides=["fl.rounds=1", f"data.corpus={tiny_corpus}",
                                         "data.languages=[en, de, fr]", "model.checkpoint=null",
                                         "data.max_utterances_per_client=4", "eval.max_utterances=8",
                                         "eval.bootstrap=20"])
    assert grid_cmd.run(args) == 0
    capsys.readouterr()
    assert main(["table", str(tmp_path / "results"), "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(line.split(",")[3] == "2" for line in lines[1:])
