"""Grid inputs end as one line naming the file or key: YAML syntax errors in grid files and
presets, truncated results under ``plot``; and what a grid's seeds mean in secure mode."""

from __future__ import annotations

import pytest

from cluster_fl.config import ConfigError
from cluster_fl.errors import UserError
from cluster_fl.sweep.gridspec import expand, load_grid
from cluster_fl.report.results import find_runs


def test_a_grid_file_with_a_yaml_syntax_error_names_the_file(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("experiment: x\naxes: {method: [name: a\n")
    with pytest.raises(ConfigError, match=r"g\.yaml is not valid YAML"):
        load_grid(grid)


def test_grid_numbers_are_read_as_users_write_them(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("experiment: x\nseeds: [0]\nset: {fl.lr: 1e-3, privacy.delta: 1e-5}\n"
                    "axes: {method: [{name: flat, set: {privacy.clipping: flat}}]}\n")
    spec = expand(load_grid(grid, out=str(tmp_path)))[0]
    assert spec.config.fl.lr == 1e-3 and spec.config.privacy.delta == 1e-5


def test_secure_mode_grid_seeds_are_replicate_labels(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("experiment: x\nseeds: [0, 1]\nset: {privacy.secure_mode: true}\n"
                    "axes: {method: [{name: flat, set: {privacy.clipping: flat}}]}\n")
    specs = expand(load_grid(grid, out=str(tmp_path)))
    assert [s.config.run.seed for s in specs] == [None, None]
    ids = [s.config.run.run_id for s in specs]
    assert len(set(ids)) == 2 and ids[0].endswith("__s0") and ids[1].endswith("__s1")


def test_a_truncated_final_parquet_is_one_line_naming_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "final.parquet").write_bytes(b"PAR1\x00\x01")
    with pytest.raises(UserError, match=r"final\.parquet: unreadable results file"):
        find_runs([tmp_path])
